"""Client rules that use the fused native SGD step give the same training as gradient edits +
torch.optim.SGD (the unfused path), and fall back when the optimizer is not plain SGD."""

import copy

import pytest
import torch
from torch import nn

from fedkernels import FlatSpec, algorithms
from fedkernels.algorithms import ClientContext


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def _train(rule, model, opt, payload, steps=4, lr=0.05):
    spec = FlatSpec.from_module(model)
    g = spec.flatten(model).clone()
    ctx = ClientContext(client_id=0, round=0, global_flat=g, spec=spec, lr=lr, num_examples=8, payload=payload)
    rule.begin(ctx, model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 1, 8, 8, generator=gen)
        y = torch.randint(0, 5, (8,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        extra = rule.loss_term(ctx, model)
        (loss + (extra if extra is not None else 0)).backward()
        rule.before_step(ctx, model)
        if not rule.step(ctx, model, opt):
            opt.step()
        ctx.step += 1
        rule.after_step(ctx, model)
    return spec.flatten(model), rule.end(ctx, model)


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 5e-4)])
def test_scaffold_fused_equals_unfused(momentum, wd):
    m0 = _model()
    d = FlatSpec.from_module(m0).d
    payload = {"c": torch.randn(d) * 0.01, "c_i": torch.randn(d) * 0.01}
    out = {}
    for fused in (True, False):
        agg = algorithms.build("scaffold", fused_step=fused)
        m = copy.deepcopy(m0)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum, weight_decay=wd)
        out[fused] = _train(agg.client_rule(), m, opt, payload)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[True][1]["delta_c"], out[False][1]["delta_c"], rtol=1e-4, atol=1e-4)


def test_fused_falls_back_for_other_optimizers():
    m0 = _model()
    d = FlatSpec.from_module(m0).d
    payload = {"c": torch.full((d,), 0.01), "c_i": torch.zeros(d)}
    res = []
    for fused in (True, False):
        m = copy.deepcopy(m0)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        res.append(_train(algorithms.build("scaffold", fused_step=fused).client_rule(), m, opt, payload)[0])
    assert torch.equal(res[0], res[1])  # nesterov is not fused: both take the same torch path


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 5e-4)])
def test_local_gc_fused_equals_unfused(momentum, wd):
    m0 = _model()
    spec = FlatSpec.from_module(m0)
    out = {}
    for fused in (True, False):
        agg = algorithms.build("gcfed", fused_step=fused)
        agg.setup(spec, num_clients=2)
        m = copy.deepcopy(m0)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum, weight_decay=wd)
        out[fused] = _train(agg.client_rule(), m, opt, {})[0]
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-6)
    assert not torch.equal(out[True], FlatSpec.from_module(m0).flatten(m0))
