"""fedkernels.optim.FusedSGD against the composed torch steps (correction added to the gradient,
GC on the raw gradient, then torch.optim.SGD), with an LR scheduler and a state_dict round trip."""

import copy

import pytest
import torch
from torch import nn

from fedkernels import reference
from fedkernels.optim import FusedSGD


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def _run(model, opt, batches, corr=None, gc=False, sched=None):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if not isinstance(opt, FusedSGD):  # the composed torch steps
            grads = [p.grad for p in model.parameters()]
            if gc:
                reference.gc_project_(grads, "skip", 2)
            if corr is not None:
                torch._foreach_add_(grads, corr)
        opt.step()
        if sched is not None:
            sched.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "momentum,wd,gc,with_corr",
    [(0.0, 0.0, False, True), (0.9, 5e-4, False, True), (0.9, 5e-4, True, False), (0.5, 1e-3, True, True)],
)
def test_matches_composed_torch_sgd_with_scheduler(momentum, wd, gc, with_corr):
    m0 = _model()
    g = torch.Generator().manual_seed(1)
    corr = [torch.randn(p.shape, generator=g) * 0.01 for p in m0.parameters()] if with_corr else None
    out = []
    for fused in (True, False):
        m = copy.deepcopy(m0)
        if fused:
            opt = FusedSGD(m.parameters(), lr=0.05, momentum=momentum, weight_decay=wd, gc=gc)
            if corr is not None:
                opt.set_correction(corr)
        else:
            opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum, weight_decay=wd)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        out.append(_run(m, opt, _batches(6), corr, gc, sched))
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)
    assert not torch.equal(out[0], torch.cat([p.detach().reshape(-1) for p in m0.parameters()]))


def test_state_dict_round_trip_continues_identically():
    m0 = _model()
    corr = {p: torch.full_like(p, 0.01) for p in m0.parameters()}
    a = copy.deepcopy(m0)
    opt_a = FusedSGD(a.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, gc=True)
    opt_a.set_correction({pa: corr[p] for pa, p in zip(a.parameters(), m0.parameters())})
    b = _batches(6)
    _run(a, opt_a, b[:3])
    st, ma = copy.deepcopy(opt_a.state_dict()), copy.deepcopy(a)
    ref = _run(a, opt_a, b[3:])
    opt_b = FusedSGD(ma.parameters(), lr=1.0)
    opt_b.load_state_dict(st)
    assert opt_b.param_groups[0]["gc"] and opt_b.param_groups[0]["momentum"] == 0.9
    assert torch.equal(_run(ma, opt_b, b[3:]), ref)
    opt_b.set_correction(None)
    assert all("correction" not in opt_b.state[p] for p in ma.parameters())


def test_param_groups_and_bad_input():
    m = _model()
    convs, lin = list(m[0].parameters()), list(m[3].parameters())
    opt = FusedSGD([{"params": convs, "gc": True}, {"params": lin, "momentum": 0.9}], lr=0.1)
    _run(m, opt, _batches(2))
    assert all("momentum_buffer" in opt.state[p] for p in lin) and all(
        "momentum_buffer" not in opt.state[p] for p in convs
    )
    for kw in ({"lr": -1.0}, {"momentum": float("nan")}, {"vector_policy": "all"}, {"min_fanin": 0}):
        with pytest.raises(ValueError):
            FusedSGD(m.parameters(), **{"lr": 0.1, **kw})
    with pytest.raises(ValueError, match="one per parameter"):
        opt.set_correction([None])
    with pytest.raises(ValueError, match="shape"):
        opt.set_correction({convs[0]: torch.zeros(3)})
