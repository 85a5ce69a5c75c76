"""The global model's evaluation (fedkernels.sim.evaluate.evaluate_global): on the data's device, one host
transfer; on the CPU the same bits as the batch-by-batch functions (evaluate.evaluate / client_losses, which
the worker processes mirror), in memory-sized batches on CUDA: the same accuracy, the loss to fp rounding."""

import numpy as np
import pytest
import torch

from fedkernels.sim import evaluate as E
from fedkernels.sim.evaluate import client_losses, evaluate
from fedkernels.sim.data import load_dataset
from fedkernels.sim.models import build_model

DATA = {}


def _setup():
    if not DATA:
        tr, te = load_dataset("digits")
        torch.manual_seed(0)
        model = build_model("digit_cnn", 10, 1, 8)
        perm = torch.from_numpy(np.random.default_rng(0).permutation(len(tr.y)))
        parts = [perm[:13], perm[13:200], perm[200:201], perm[201:640], perm[640:640]]  # one empty client
        DATA.update(model=model, tr=tr, te=te, parts=parts)
    return DATA["model"], DATA["tr"], DATA["te"], DATA["parts"]


@pytest.mark.parametrize("bs", [97, 1024])
def test_same_bits_as_the_batch_by_batch_functions_on_the_cpu(bs):
    model, tr, te, parts = _setup()
    model.train()
    who = [3, 0, 2, 4]
    acc, tl, cl = E.evaluate_global(model, te.x, te.y, bs, tr.x, tr.y, parts, who)
    assert model.training  # its mode restored
    assert (acc, tl) == evaluate(model, te.x, te.y, bs)
    assert cl == client_losses(model, tr.x, tr.y, parts, who, bs)
    assert cl[3] == 0.0 and len(cl) == 4
    assert E.evaluate_global(model, te.x, te.y, bs, tr.x, tr.y, parts, [])[2] == []
    assert E.evaluate_global(model, te.x, te.y, bs)[2] is None


def test_large_batches_same_accuracy_loss_to_rounding(monkeypatch):
    """As on CUDA (pretended here on the CPU): rows from the free memory, at least eval_batch_size."""
    model, tr, te, parts = _setup()
    who = [0, 1, 3]
    ref = E.evaluate_global(model, te.x, te.y, 50, tr.x, tr.y, parts, who)
    monkeypatch.setattr(E, "GPU_DEVICES", ("cuda", "cpu"))
    per = E.row_bytes(model.eval(), te.x)
    assert per > te.x[:1].numel() * 4  # the input row and every module's output
    assert E.eval_rows(model, te.x, 50, free=4 * per * 120) == 120
    assert E.eval_rows(model, te.x, 50, free=4 * per * 10) == 50  # never fewer than eval_batch_size
    assert E.eval_rows(model, te.x, 50, free=2**40) == len(te.y)  # never more than the set
    assert E.eval_rows(model, te.x, 5000, free=2**40) == 5000  # a set within one batch
    rows = []
    orig = E.eval_batch
    monkeypatch.setattr(E, "eval_batch", lambda m, xb, yb, c: (rows.append(len(yb)), orig(m, xb, yb, c))[1])
    acc, tl, cl = E.evaluate_global(model, te.x, te.y, 50, tr.x, tr.y, parts, who, free=2**40)
    assert rows == [len(te.y)]  # the whole test set in one forward
    assert acc == ref[0]
    assert tl == pytest.approx(ref[1], rel=1e-6) and cl == pytest.approx(ref[2], rel=1e-6)


def test_empty_test_set_and_missing_training_data():
    model, tr, te, parts = _setup()
    acc, tl, _ = E.evaluate_global(model, te.x[:0], te.y[:0], 64)
    assert np.isnan(acc) and np.isnan(tl)
    with pytest.raises(ValueError, match="clients given without the training data"):
        E.evaluate_global(model, te.x, te.y, 64, clients=[0])
