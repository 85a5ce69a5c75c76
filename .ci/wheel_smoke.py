"""Smoke test of an installed fedkernels wheel (run by .ci/wheel_check.sh in a fresh venv, from a
directory outside the repository so that the installed package, not the checkout, is imported).

Checks: the package imports from site-packages, its extension was built for the torch that runs it
and for the requested -march, one weighted_sum equals the float64 reference, one FedAvg aggregation
equals the hand-computed weighted mean, and the lazily imported subpackages resolve."""

import os
import sys

import torch

import fedkernels
from fedkernels import algorithms, ops, reference

site = os.path.realpath(os.path.dirname(fedkernels.__file__))
assert "site-packages" in site, f"fedkernels imported from {site}, not from the installed wheel"
info = fedkernels.build_info()
print("installed:", site)
print("build_info:", info)
want_march = os.environ.get("EXPECT_MARCH")
if want_march is not None:
    assert info["march"] == want_march, f"wheel built with -march={info['march']}, expected {want_march}"
assert info["torch_version"].split(".")[:2] == torch.__version__.split(".")[:2], info

g = torch.Generator().manual_seed(0)
K, d = 16, 100_003
U = torch.randn(K, d, generator=g)
coef = torch.rand(K, generator=g)
base = torch.randn(d, generator=g)
out = ops.weighted_sum(U, coef, base=base, alpha=0.5)
ref = reference.weighted_sum(U.double(), coef.double(), base=base.double(), alpha=0.5)
err = (out.double() - ref).abs().max().item()
assert err < 1e-4, f"weighted_sum differs from the float64 reference by {err}"

n = torch.tensor([10.0, 30.0, 60.0])
x = torch.randn(d, generator=g)
Uk = U[:3].contiguous()
agg = algorithms.build("fedavg")
new, _ = agg.aggregate(x, Uk, n, [0, 1, 2])
expect = x.double() + (n.double()[:, None] * Uk.double()).sum(0) / n.sum().double()
err2 = (new.double() - expect).abs().max().item()
assert err2 < 1e-5, f"FedAvg differs from the weighted mean by {err2}"
assert callable(fedkernels.distributed.ShardedAggregator) and fedkernels.streaming is not None
print(f"wheel smoke test passed (weighted_sum err {err:.1e}, fedavg err {err2:.1e})")
sys.exit(0)
