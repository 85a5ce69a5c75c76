"""CUDA behaviour that belongs to no single op: several ops' kernels captured in one CUDA graph.

Each op's CUDA cases live in its own tests/test_<op>.py, parametrised by device (tests/devices.py);
run them on a GPU machine with ``python -m pytest -m cuda tests/``.
"""

from __future__ import annotations

import torch

from devices import DEV, NEEDS_CUDA, cuda_only, gen, randn  # tests/devices.py
from fedkernels import ops

__all__ = ["NEEDS_CUDA"]  # older op test files import it from here; tests/devices.py defines it


@cuda_only
def test_host_coef_ops_capture_in_a_cuda_graph():
    U = randn(DEV, 10, 4099, seed=41)
    coef = torch.rand(10, generator=gen(42), dtype=torch.float64)
    out = torch.empty(4099, device=DEV)
    want = torch.ops.fedkernels.weighted_sum(U, coef, None, 1.0, None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.fedkernels.weighted_sum_out(U, coef, None, 1.0, None, out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ops.fedkernels.weighted_sum_out(U, coef, None, 1.0, None, out)
        ops.gc_project_([U[:4].view(4, 4099)], "skip")
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
