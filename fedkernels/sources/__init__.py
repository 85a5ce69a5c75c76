"""Matrix sources: one interface over a K x d update matrix, in memory or on disk, read in column blocks.

A server receives K client updates of d parameters. Where they live differs (a tensor in memory, a
NumPy / torch memmap, one raw file holding all K rows, one file per client as a real server writes
them on arrival); what an aggregation needs is the same: the columns ``[a, b)`` of all K rows, in
column order, one block at a time. ``MatrixSource`` is that interface:

* ``K``, ``d``, ``dtype`` (float16, bfloat16, float32 or float64), ``shape``;
* ``chunks(chunk_cols, check_finite=False)`` yields ``(a, b, block)`` for ``a = 0, c, 2c, ...`` with
  ``block`` a [K, b - a] CPU tensor whose rows are contiguous (unit column stride; in-memory sources
  give views, file sources a reused staging buffer: the block is valid until the next one). With
  ``check_finite`` each block is screened with ``ops.finite_rows`` and the first client row holding
  NaN/Inf raises ``BadUpdateError`` naming the row (and its file) and the columns;
* ``row_name(k)``: how errors name client row k (``client row 3`` or ``client row 3 (c3.bin)``).

Implementations: ``TensorSource`` (a [K, d] CPU tensor, e.g. from ``torch.from_file``),
``MemmapSource`` (a [K, d] NumPy array or ``np.memmap``; a uint16 memmap read as bfloat16 with
``dtype=torch.bfloat16``, since NumPy has no bfloat16; pages of a disk-backed memmap are released
after each block so the resident set stays bounded), ``RawFileSource`` (a raw little-endian
row-major file, read with ``os.preadv`` into a staging tensor: any of the four dtypes, bf16 included,
no NumPy dtype involved) and ``ClientFilesSource`` (a list of K raw files of d elements each, one per
client row). ``as_source(x, ...)`` builds the right one. ``ChunkedUpdates`` reads a source ``chunk_cols``
columns at a time onto a device (to a GPU through two pinned staging blocks and a copy stream, the
copy of chunk i+1 overlapping the work on chunk i: :func:`overlapped`; ``device="auto"``: the CPU or
the GPU, whichever runs the method's round sooner, :func:`pick_device`); every ``Aggregator.aggregate``
takes either as its ``updates`` (``fedkernels.algorithms.base.RoundInput`` reads them chunk by chunk),
and ``select_rows`` keeps the accepted clients' rows when some are excluded, errors still naming the
original rows.

The modules, by concern: ``matrix`` (the interface, the in-memory sources, the dtype checks), ``files`` (the
file sources and their reads: READ_BYTES blocks, O_DIRECT), ``chunked`` (``ChunkedUpdates``, ``as_source``,
``weighted_sum_block``), ``staging`` (host -> CUDA copies overlapped with compute), ``cost`` (the device
cost model of ``device="auto"``: ``pick_device`` and the probed rates) and ``packed`` (``PackedRows``,
``BlockCodeFile``). The public names are exported here.
"""

from .chunked import ChunkedUpdates, as_source, weighted_sum_block
from .cost import (
    HOST,
    PASSES,
    cpu_gram_gbps,
    cpu_read_gbps,
    h2d_gbps,
    pick_device,
    round_passes,
    round_seconds,
    staging_gbps,
)
from .files import ClientFilesSource, RawFileSource
from .matrix import FLOAT_DTYPES, MatrixSource, MemmapSource, TensorSource, itemsize
from .packed import BlockCodeFile, PackedRows
from .staging import CudaCalls, overlapped

__all__ = [
    "MatrixSource",
    "TensorSource",
    "MemmapSource",
    "RawFileSource",
    "ClientFilesSource",
    "as_source",
    "ChunkedUpdates",
    "overlapped",
    "CudaCalls",
    "pick_device",
    "cpu_read_gbps",
    "h2d_gbps",
    "cpu_gram_gbps",
    "PASSES",
    "HOST",
    "round_passes",
    "round_seconds",
    "staging_gbps",
    "weighted_sum_block",
    "FLOAT_DTYPES",
    "itemsize",
    "BlockCodeFile",
    "PackedRows",
]
