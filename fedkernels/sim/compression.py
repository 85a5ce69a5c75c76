"""The simulator's compressed updates (config section ``compress``): each accepted client's update row is
encoded as that client would before sending it (``fedkernels.compress`` codecs, error-feedback residuals per
client, kept in memory and in the run's checkpoints, or with ``compress.residual_file`` in a file table that the
checkpoints reference), and the server's round runs on the compressed rows (``aggregate_compressed``: the
round runner's round, the method's weighted sums straight from the codes). The model's buffers (BatchNorm statistics)
are sent uncompressed beside the codes and averaged as for dense rows. Bytes sent per round (codes, scales or lists,
and those buffers) go to the round's metrics."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import compress
from ..algorithms.buffers import buffer_ranges
from .config import CompressConfig


class RoundCompression:
    """The run's codec and its per-round server step."""

    def __init__(self, codec: compress.Codec):
        self.codec = codec

    def aggregate(
        self,
        agg: Any,
        global_flat: torch.Tensor,
        U: torch.Tensor,
        n: Sequence[float],
        ids: Sequence[int],
        payloads: Any,
        r: int,
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        K = len(ids)
        rows = self.codec.encode_rows(U[:K], ids, r)  # client-side: each row as its client sends it
        sent = sum(rows.nbytes())
        ranges = buffer_ranges(getattr(agg, "spec", None))
        if ranges and getattr(agg.spec, "d", None) == self.codec.d:
            # the model's buffers (BatchNorm statistics) travel uncompressed beside the codes: the round runner
            # averages them as it does dense rows' (the same bits); 4 bytes a buffer element a client (fp32)
            V = torch.cat([U[:K, a:b] for a, b in ranges], 1)
            rows = rows.with_dense_columns(ranges, V)
            sent += V.numel() * V.element_size()
        res = compress.aggregate_compressed(agg, global_flat, rows, n, ids, payloads, kind=self.codec.kind)
        info = dict(res.info)
        info.update(
            codec=self.codec.describe(), bytes_sent=int(sent), bytes_dense=int(K * compress.dense_bytes(self.codec.d))
        )
        return res.params, info


def build(cfg: Any, agg: Any, d: int) -> Optional[RoundCompression]:
    """The run's compression, or None for ``compress.kind = none``; ValueError (one line) for options that do not
    fit this model (block or k against d) or a method that needs more than weighted sums of the updates."""
    c: CompressConfig = cfg.compress
    if c.kind == "none":
        return None
    compress.check_method(agg, c.kind)
    codec = compress.make_codec(
        c.kind,
        d,
        block=c.block,
        k=c.k,
        ratio=c.ratio,
        error_feedback=c.error_feedback,
        levels=c.levels,
        seed=cfg.seed if c.seed is None else c.seed,
        residual_file=c.residual_file,
        num_clients=cfg.num_clients,
    )
    return RoundCompression(codec)


def config_errors(c: CompressConfig, checkpoint_every: int, distributed: bool) -> List[str]:
    """The section's checks that need no model (kinds, ranges, option combinations), as RunConfig.validate's lines."""
    errs: List[str] = []
    kinds = ("none",) + compress.KINDS
    if c.kind not in kinds:
        return [f"compress.kind must be {'|'.join(kinds)}, got {c.kind!r}"]
    if c.kind == "none":
        set_ = [k for k in ("block", "k", "ratio", "residual_file") if getattr(c, k) is not None] + (
            ["error_feedback"] if c.error_feedback else []
        )
        if set_:
            errs.append(f"compress.{set_[0]} is set but compress.kind is none: set compress.kind too")
        return errs
    if c.block is not None and (isinstance(c.block, bool) or c.block < 1):
        errs.append(f"compress.block must be an integer >= 1 (columns per scale, at most d), got {c.block}")
    if c.kind == "topk":
        if c.block is not None:
            errs.append(f"compress.block is not used by topk (got {c.block}); set compress.k or compress.ratio")
        if (c.k is None) == (c.ratio is None):
            errs.append(
                f"compress.kind=topk needs exactly one of compress.k and compress.ratio, got k={c.k}, ratio={c.ratio}"
            )
        elif c.k is not None and c.k < 1:
            errs.append(f"compress.k must be an integer >= 1 (at most d), got {c.k}")
        elif c.ratio is not None and not 0 < c.ratio <= 1:
            errs.append(f"compress.ratio must be in (0, 1], got {c.ratio}")
    elif c.k is not None or c.ratio is not None:
        errs.append(f"compress.k / compress.ratio are topk's; compress.kind={c.kind} takes compress.block")
    if c.kind == "qsgd" and not 1 <= c.levels <= 127:
        errs.append(f"compress.levels must be in [1, 127] (qsgd's s, stored as int8), got {c.levels}")
    if c.residual_file is not None and not c.error_feedback:
        errs.append(
            f"compress.residual_file is set ({c.residual_file!r}) but compress.error_feedback is false: "
            "there are no residuals to keep"
        )
    if distributed:
        errs.append("compress.kind with distributed=true is not supported (ranks exchange dense column slices)")
    return errs
