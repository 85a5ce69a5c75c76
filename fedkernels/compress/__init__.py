"""Compressed updates: client-side codecs (int8 blocks, fp8 e4m3 blocks, top-k, QSGD; error feedback) and the
server's round on the compressed rows without a dense copy (``aggregate_compressed``), for the methods whose
server needs only weighted sums of the updates. See docs/compression.md."""

from .codecs import KINDS, BlockRows, Codec, SparseRows, dense_bytes, make_codec
from .server import aggregate_compressed, check_method, weighted_sum_methods

__all__ = [
    "KINDS",
    "Codec",
    "BlockRows",
    "SparseRows",
    "make_codec",
    "dense_bytes",
    "aggregate_compressed",
    "check_method",
    "weighted_sum_methods",
]


def __getattr__(name: str):
    if name == "WEIGHTED_SUM_METHODS":  # computed when read (compress.server)
        from . import server

        return server.WEIGHTED_SUM_METHODS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
