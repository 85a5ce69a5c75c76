"""Model buffers (BatchNorm's running mean and variance, any float buffer the FlatSpec records) in
the aggregated model: whatever the method, they become the sample-weighted average of the
participating clients' buffers, ``global + sum_k p_k U_k`` with ``p_k = n_k / sum n`` over the buffer
columns.

Buffers are statistics, not parameters: a method's server step (momentum, an ODE flow, an adaptive
or extrapolating step, a server learning rate above 1) is meant for the parameters, and applied to a
running variance it can make it negative (FedECADO, FedAvgM on a BatchNorm model: NaN test losses
from round 2). A convex combination of the clients' buffers keeps a variance >= 0 and a mean within
the clients' range. Cost: one ``weighted_sum`` over the buffer column ranges only (K x the buffer
count elements read, nothing else of U); FedAvg's own result there is the same average, so FedAvg is
unchanged bit for bit.

A no-op without a FlatSpec (library use without ``setup(spec)``), for a spec without buffers, for
updates read from a chunked source (``fedkernels.sources``; their column chunks cover all of d), and
where the spec does not describe U's columns. Compressed rows (``sources.PackedRows``): from the buffer
columns sent uncompressed alongside them (``with_dense_columns``; the simulator sends them so: the same
bits as dense rows), else from the codes decoded on those columns only (a variance stays >= 0 up to the
codec's error on the clients' buffer updates). FedBN's "keep the buffers local" is not offered: it needs
per-client buffer storage between rounds, which the simulator's clients do not keep."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import ops
from ..flat import FlatSpec


def buffer_ranges(spec: Optional[FlatSpec]) -> List[Tuple[int, int]]:
    """The column ranges ``[a, b)`` of ``spec``'s buffers, adjacent ones merged, in column order."""
    if spec is None:
        return []
    out: List[Tuple[int, int]] = []
    for e in sorted((e for e in spec.entries if e.is_buffer and e.numel > 0), key=lambda e: e.offset):
        a, b = e.offset, e.offset + e.numel
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def average_buffers(spec: Optional[FlatSpec], rin, params: torch.Tensor) -> torch.Tensor:
    """``params`` (the method's new [d] model, written in place) with its buffer columns set to the
    sample-weighted average of the round's clients' buffers (``rin``: the round's validated input, its
    accepted rows). Returns ``params``."""
    ranges = buffer_ranges(spec)
    if not ranges or rin.K == 0 or rin.src is not None or spec.d != rin.d or params.numel() != rin.d:
        return params
    p = rin.sample_weights()
    g = rin.global_flat
    if rin.packed is not None:
        # compressed rows: the buffer columns sent uncompressed alongside (the same bits as dense rows), else
        # decoded from the codes; a form that can do neither (a codes file) keeps the method's result
        V = rin.packed.dense_columns(ranges)
        if V is None:
            return params
        V = V.to(device=g.device, dtype=g.dtype)
        at = 0
        for a, b in ranges:
            ops.weighted_sum(V[:, at : at + b - a], p, base=g[a:b], out=params[a:b])
            at += b - a
        return params
    U = rin.U
    for a, b in ranges:
        ops.weighted_sum(U[:, a:b], p, base=g[a:b], out=params[a:b])
    return params
