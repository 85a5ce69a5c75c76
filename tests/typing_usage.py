"""User code written against fedkernels' annotations: tests/test_typing.py type-checks this file
with mypy (strict about untyped calls and Any results, so a public function that loses its types
fails) and also runs it, so what mypy accepts here really works."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from typing_extensions import assert_type  # a no-op at run time; mypy checks the exact type

import fedkernels
from fedkernels import FlatSpec, UpdateBuffer, ops, reference
from fedkernels.algorithms.base import (
    AggResult,
    Aggregator,
    ClientContext,
    ClientRule,
    RoundInput,
    available,
    build,
    register,
)
from fedkernels.errors import BadUpdateError
from fedkernels.optim import FusedSGD


NAME = "typing_usage_mean"  # registered by run(); the test removes it again


class MeanAggregator(Aggregator):
    """A user-defined aggregator: the plain mean of the updates."""

    def _aggregate(self, rin: RoundInput) -> AggResult:
        coef: List[float] = [1.0 / rin.K] * rin.K
        new: torch.Tensor = ops.weighted_sum(rin.U, coef, base=rin.global_flat)
        return AggResult(new, {"K": rin.K})


class NoteRule(ClientRule):
    def end(self, ctx: ClientContext, model: nn.Module) -> Dict[str, object]:
        return {"steps": ctx.step}


def run() -> Tuple[torch.Tensor, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    spec: FlatSpec = FlatSpec.from_module(model)
    buf = UpdateBuffer(3, spec)
    for k in range(3):
        buf.row(buf.add(k, 10.0 * (k + 1))).normal_()
    U: torch.Tensor = buf.matrix()
    info = fedkernels.build_info()
    assert_type(info, Dict[str, Any])
    assert "torch_version" in info

    G = ops.gram(U)
    assert_type(G, torch.Tensor)
    mn = ops.min_norm(G)
    assert_type(mn, Tuple[torch.Tensor, Union[int, torch.Tensor], Union[float, torch.Tensor]])
    lam, iters, gap = mn
    lam_ref, iters_ref, gap_ref = reference.min_norm(G)
    assert_type(iters_ref, int)
    assert isinstance(iters, int) and isinstance(gap, float) and iters_ref >= 0
    ok = ops.finite_rows(U)
    assert ops.all_(ok) and not ops.any_(~ok)
    s = ops.dot(U[0], U[1]) + ops.sqnorm(U[2])
    assert_type(s, float)

    views = ops.gc_project([U.clone().view(3, -1)])
    assert_type(views, List[torch.Tensor])
    ops.gc_project_flat_(U.clone(), spec, select=lambda e: not e.is_buffer)

    A = torch.eye(3, dtype=torch.float64) * 2.0
    f = ops.lu_factor(A)
    assert_type(f, Tuple[torch.Tensor, torch.Tensor])
    X = ops.lu_solve(*f, torch.ones(3, 2, dtype=torch.float64))
    assert_type(X, torch.Tensor)
    x, I = ops.arrowhead_solve(
        [2.0, 2.0, 2.0], -0.1, 0.1, 1.0, torch.zeros(4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    )
    assert X.shape == (3, 2) and x.shape == (4,) and I.shape == (3, 4)

    cls = register(NAME)(MeanAggregator)
    assert_type(cls, type[MeanAggregator])
    agg = build(NAME)
    assert_type(agg, Aggregator)
    assert NAME in available()
    res = agg.aggregate(spec.flatten(model), U, buf.num_examples, client_ids=buf.client_ids)
    try:
        agg.aggregate(res.params, [U[0], torch.zeros(1)], [1.0, 1.0])
    except BadUpdateError:
        pass
    rule: Optional[ClientRule] = NoteRule(agg)
    assert rule is not None

    opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, gc=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model(torch.randn(2, 5)).sum().backward()
    assert_type(opt.step(), None)
    sched.step()
    out = opt.step(lambda: 0.5)
    assert_type(out, float)
    assert out == 0.5
    return res.params, s + float(lam.sum()) + float(lam_ref.sum()) + float(len(views)) + float(gap_ref)


if __name__ == "__main__":
    print(run()[1])
