"""The device cost model of ``device="auto"``: the CPU or the GPU, whichever runs a method's round on a host
matrix sooner (:func:`pick_device`), from the passes the method declares (:data:`PASSES`) and rates probed
once per process (:func:`cpu_read_gbps`, :func:`cpu_gram_gbps`, :func:`h2d_gbps`, :func:`staging_gbps`)."""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from .. import ops
from .matrix import MatrixSource, check_pos_int

PROBE_BYTES = 64 << 20
GRAM_PROBE_FMAS = 1 << 27  # at most this many fused multiply-adds per timed call of the Gram probe
_BANDWIDTH: Dict[str, float] = {}  # GB/s measured once per process: "cpu", "h2d", "stage", "gram:K"

# A round as device="auto" weighs it: the passes an aggregator makes (``Aggregator.passes()``, in order), each
# costed in B, the bytes of U (K x d x its itemsize): (B read by the CPU at cpu_read_gbps(), B at cpu_gram_gbps(K),
# whether the pass reads B of host data, U or payloads, so over the link when the round runs on the GPU). A table's
# passes are counted on its K round rows (as if N = K: more clients only add CPU work) and cost nothing on the GPU,
# where the table lives with the model; prefixed HOST they run on the host wherever the round runs (a table kept
# in host memory or in a file): the same CPU time on both sides, nothing over the link.
PASSES: Dict[str, Tuple[int, int, bool]] = {
    "sum": (1, 0, True),  # a column-local read of U: weighted_sum, the NaN/Inf screen, an EMA of U into a table
    "gram": (0, 1, True),  # U's K x K Gram matrix (fp64 accumulation)
    "table": (2, 0, False),  # a table's K round rows read and written (FedAWARE's momenta, SCAFFOLD's c_i)
    "table_gram": (0, 1, False),  # those rows' Gram against the table (FedAWARE)
    "table_sum": (1, 0, False),  # a weighted sum over those rows (FedAWARE's step, SCAFFOLD's sum of delta_c)
    "payload": (1, 0, True),  # K client payloads of d elements each (SCAFFOLD's delta_c): stacked, sent to the GPU
}
HOST = "host:"


def _kind(p: str) -> str:
    """A pass's entry in PASSES (its name without the HOST prefix)."""
    return p[len(HOST) :] if p.startswith(HOST) else p


def cpu_read_gbps() -> float:
    """GB/s of the CPU op ``ops.weighted_sum`` reading a host [16, PROBE_BYTES / 64] fp32 matrix (best of
    three, with torch's current thread count); measured once per process."""
    if "cpu" not in _BANDWIDTH:
        U = torch.ones(16, PROBE_BYTES // 64)
        coef = torch.full((16,), 1 / 16, dtype=torch.float64)
        _BANDWIDTH["cpu"] = U.numel() * 4 / _best(lambda: ops.weighted_sum(U, coef)) / 1e9
    return _BANDWIDTH["cpu"]


def cpu_gram_gbps(K: int) -> float:
    """GB/s of U's bytes through the CPU op ``ops.gram`` on a host [K, n] fp32 matrix, n columns holding at
    most a CPU chunk (CPU_CHUNK_BYTES: what the op gets per chunk of a source on the CPU) and GRAM_PROBE_FMAS
    fused multiply-adds (K (K + 1) / 2 per column) (best of three, with torch's current thread count);
    measured once per process and K. Near the read rate at small K, it falls as 1/K where the Gram is
    compute-bound."""
    K = check_pos_int(K, "cpu_gram_gbps", "K")
    key = f"gram:{K}"
    if key not in _BANDWIDTH:
        from . import chunked  # (chunked imports this module)

        n = max(256, min(chunked.CPU_CHUNK_BYTES // (4 * K), GRAM_PROBE_FMAS // (K * (K + 1) // 2)))
        U = torch.ones(K, n)
        _BANDWIDTH[key] = U.numel() * 4 / _best(lambda: ops.gram(U)) / 1e9
    return _BANDWIDTH[key]


def h2d_gbps() -> float:
    """GB/s of a pinned host-to-device copy of PROBE_BYTES to the current CUDA device (best of three);
    measured once per process."""
    if "h2d" not in _BANDWIDTH:
        src = torch.empty(PROBE_BYTES // 4, pin_memory=True)
        dst = torch.empty_like(src, device="cuda")
        _BANDWIDTH["h2d"] = PROBE_BYTES / _best(lambda: dst.copy_(src, non_blocking=True), torch.cuda.synchronize) / 1e9
    return _BANDWIDTH["h2d"]


def staging_gbps() -> float:
    """GB/s of the host copy into pinned memory that stages each chunk for the link (best of three);
    measured once per process."""
    if "stage" not in _BANDWIDTH:
        src, dst = torch.ones(PROBE_BYTES // 4), torch.empty(PROBE_BYTES // 4, pin_memory=True)
        _BANDWIDTH["stage"] = PROBE_BYTES / _best(lambda: dst.copy_(src)) / 1e9
    return _BANDWIDTH["stage"]


def _best(fn: Callable[[], Any], wait: Callable[[], Any] = lambda: None) -> float:
    """The shortest of three timed calls of ``fn`` (then ``wait``), after one untimed."""
    fn()
    wait()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn()
        wait()
        best = min(best, time.perf_counter() - t)
    return best


def round_passes(method, K: Optional[int] = None) -> Tuple[Tuple[str, ...], str]:
    """(the passes, a label) of ``method`` for a round of ``K`` clients (None: not known): None (one weighted
    sum, what a caller naming no method gets), an aggregator (its ``passes(K)``, or ``passes()`` where it takes
    no K, labelled by its ``name``) or a sequence of pass names; ValueError naming a pass that is not in PASSES
    (optionally prefixed HOST)."""
    if method is None:
        return ("sum",), "one weighted sum"
    if isinstance(method, (list, tuple)):
        passes, label = tuple(method), "passes"
    elif callable(getattr(method, "passes", None)):
        takes_k = "K" in inspect.signature(method.passes).parameters
        passes = tuple(method.passes(K) if takes_k else method.passes())
        label = str(getattr(method, "name", type(method).__name__))
    else:
        raise TypeError(
            f"pick_device: method must be an aggregator (with passes()), a sequence of pass names or "
            f"None, got {type(method).__name__}"
        )
    for p in passes:
        if not isinstance(p, str) or _kind(p) not in PASSES:
            raise ValueError(
                f"pick_device: {label} declares the pass {p!r}; expected one of {sorted(PASSES)}, "
                f"optionally prefixed {HOST!r}"
            )
    return passes, label


def round_seconds(passes: Sequence[str], K: int) -> Tuple[float, float, int]:
    """(CPU seconds, seconds of host work on the GPU path, reads of U over the link on the GPU path) per GB
    of U of a round of ``passes`` over a host [K, d] matrix, from the probed CPU rates (PASSES)."""
    cpu, host, link_reads = 0.0, 0.0, 0
    for p in passes:
        on_host = p.startswith(HOST)
        r, g, reads_u = PASSES[_kind(p)]
        t = (r / cpu_read_gbps() if r else 0.0) + (g / cpu_gram_gbps(K) if g else 0.0)
        cpu += t
        if on_host:
            host += t
        elif reads_u:
            link_reads += 1
    return cpu, host, link_reads


def pick_device(method=None, data=None) -> Tuple[torch.device, str]:
    """Where one round of ``method`` on ``data`` runs sooner, and why (one short string with both estimates).

    method: an aggregator (what a round does with U: its ``passes()``, see PASSES), a sequence of pass names,
    or None (one weighted sum). data: the [K, d] updates: a tensor, a ``MatrixSource`` or a ``ChunkedUpdates``
    (None: a host matrix of K = 16 rows, 1 GB). Data already on a CUDA device: that device. No CUDA: the
    CPU. Otherwise the CPU time (per pass: its bytes over the probed CPU rate of that pass,
    :func:`cpu_read_gbps` / :func:`cpu_gram_gbps` at data's K) against the GPU time (the bytes of U over
    the link for each pass that reads U from the host, the slower of the two overlapped stages a chunk goes
    through: :func:`staging_gbps` into pinned memory, :func:`h2d_gbps` over the link; plus the passes that
    stay on the host; the GPU's own compute counted as nothing): the faster, the CPU on a tie. Each rate is
    probed once per process. The source itself (a disk, a memmap) is read the same way for both; a bf16/fp16
    matrix is costed by its bytes at the fp32 rates."""
    from .chunked import ChunkedUpdates  # (chunked imports this module: pick_device is its device="auto")

    K, nbytes, where = 16, 10**9, torch.device("cpu")
    if isinstance(data, torch.Tensor):
        K, nbytes, where = (data.size(0) if data.dim() else 1), data.numel() * data.element_size(), data.device
    elif isinstance(data, (MatrixSource, ChunkedUpdates)):
        src = data.source if isinstance(data, ChunkedUpdates) else data
        K, nbytes = src.K, src.nbytes
    elif data is not None:
        raise TypeError(
            f"pick_device: data must be a tensor, a MatrixSource or a ChunkedUpdates, got {type(data).__name__}"
        )
    passes, label = round_passes(method, K)
    if where.type == "cuda":
        return where, f"{where}: the data is already there"
    if not torch.cuda.is_available():
        return torch.device("cpu"), "cpu: no CUDA device"
    gb = nbytes / 1e9
    cpu, host, link_reads = round_seconds(passes, max(K, 1))
    link = min(h2d_gbps(), staging_gbps())
    cpu, host, gpu = gb * cpu, gb * host, gb * (host + link_reads / link)
    rates = f"reads {cpu_read_gbps():.1f} GB/s"
    if any(PASSES[_kind(p)][1] for p in passes):
        rates += f", Gram at K={K} {cpu_gram_gbps(max(K, 1)):.1f} GB/s"
    on_gpu = f"{link_reads} read{'s' if link_reads != 1 else ''} of U at the staged host-to-device {link:.1f} GB/s"
    if host:
        on_gpu += f" + {host:.3g} s on the host"
    dev = torch.device("cpu") if cpu <= gpu else torch.device("cuda", torch.cuda.current_device())
    return dev, (
        f"{dev}: host source, {label} [{', '.join(passes)}] on {nbytes / 1e9:.3g} GB: CPU ~{cpu:.3g} s "
        f"({rates}) {'<=' if cpu <= gpu else '>'} GPU ~{gpu:.3g} s ({on_gpu})"
    )
