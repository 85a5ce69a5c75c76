"""Validated Python API over the native ops (``torch.ops.fedkernels.*``), one module per op (or family),
named like the op:

====================  ==========================================================================
``gram``              ``gram``, ``gram_screened`` (the K x K Gram matrix of the update rows)
``weighted_sum``      ``weighted_sum``, ``weighted_sum_screened``, ``weighted_sum_chunked``
``finite_rows``       ``finite_rows`` (the NaN/Inf screen of the update rows)
``kstats``            ``kstats`` (Kuramoto's phase statistics and the NaN/Inf screen in one pass, no Gram)
``select``            ``order_mean``, ``order_mean_screened``, ``closest_mean``, ``closest_mean_screened``
                      (per-column selection: coordinate-wise median, trimmed mean, Bulyan's step)
``min_norm``          ``min_norm`` (FedAWARE's min-norm point on the Gram matrix)
``gc_project``        ``gc_project_``, ``gc_project``, ``gc_project_flat_`` (GC-Fed)
``lu``                ``lu_factor``, ``lu_factor_ex``, ``lu_solve``, ``arrowhead_solve`` (FedECADO)
``fedecado_be_step``  ``fedecado_be_step`` (FedECADO's fused backward-Euler step; ``BEStepWindow``: its
                      attempts over one integration window, the fixed arguments checked once)
``fused_sgd_step``    ``fused_sgd_step_``, ``corrected_sgd_step_``, ``gc_sgd_step_`` (local steps)
``gaussian_noise``    ``add_gaussian_noise_``, ``weighted_sum_noised``, ``philox_normal`` (the DP noise:
                      Philox4x32-10 + Box-Muller, the same bits on every device)
``server_opt_step``   ``server_opt_step_`` (FedAdam / FedYogi / FedAdagrad's fused m, v and model update)
``dequant_weighted_sum``  ``dequant_weighted_sum`` (int8 / fp8 blockwise rows summed without a dequantised copy)
``sparse_weighted_sum``   ``sparse_weighted_sum``, ``stack_lists`` (K index/value lists summed, top-k rows)
``reductions``        ``dot``, ``sqnorm``, ``all_``, ``any_`` / ``any_flag``, ``amax_d``, ``mean_d``
                      and the sharded mode (``reduce_across``, ``active_reducer``)
``_autograd``         the autograd / vmap machinery the op modules share (each op registers its
                      own derivative, or a clear error on backward, beside its wrapper)
====================  ==========================================================================

Every argument is checked once, before any work, with a one-line ValueError (TypeError for
non-tensors) naming the op, the argument, the value and what was expected: a tensor's shape, dtype,
device and layout by the native op (``csrc/<op>_checks.h``, for every caller: the wrapper, a direct
``torch.ops.fedkernels`` call, a compiled graph), types and values by the wrapper (``_checks``:
row indices in range, finite coefficients, options). Non-contiguous inputs are
accepted: a matrix only needs a unit column stride (a column chunk ``U[:, a:b]`` of a contiguous
buffer is used without a copy); anything else is copied once. Small per-client vectors (``coef``,
``rows``, FedECADO's scalars) are validated on the host and passed to the native op as host
tensors for every device.

NaN policy: the ops do not scan their inputs for NaN/Inf on the hot path; NaN and Inf propagate
as in IEEE arithmetic (a NaN in a selected row of ``U`` makes the matching output entries NaN).
Screening is explicit and cheap: ``finite_rows(U)`` reads U once and says which rows are finite,
and ``weighted_sum_screened`` / ``gram_screened`` return the same flags from the op's own pass (no
extra read); the aggregators use them to reject or exclude bad clients (see ``Aggregator.aggregate``).

torch.compile: the wrappers trace with ``fullgraph=True``; the checks that need tensor values are
skipped while tracing (the kernels keep their own range checks), and the native op checks the
tensors when the graph runs.
"""

from __future__ import annotations

from .. import _native

_native.require()

from ._checks import FLOAT_DTYPES, RowsLike  # noqa: E402
from .finite_rows import finite_rows  # noqa: E402
from .gram import gram, gram_screened  # noqa: E402
from .kstats import kstats  # noqa: E402
from .select import closest_mean, closest_mean_screened, order_mean, order_mean_screened  # noqa: E402
from .weighted_sum import weighted_sum, weighted_sum_chunked, weighted_sum_screened  # noqa: E402
from .fedecado_be_step import BEStepWindow, fedecado_be_step  # noqa: E402
from .gaussian_noise import add_gaussian_noise_, philox_normal, weighted_sum_noised  # noqa: E402
from .fused_sgd_step import corrected_sgd_step_, fused_sgd_step_, gc_sgd_step_  # noqa: E402
from .gc_project import GC_VECTOR_POLICIES, gc_project, gc_project_, gc_project_flat_  # noqa: E402
from .lu import LU_MAX_N, arrowhead_solve, lu_factor, lu_factor_ex, lu_solve  # noqa: E402
from .server_opt_step import SERVER_OPT_RULES, server_opt_step_  # noqa: E402
from .min_norm import MIN_NORM_INITS, MIN_NORM_METHODS, min_norm  # noqa: E402
from .dequant_weighted_sum import dequant_weighted_sum  # noqa: E402
from .sparse_weighted_sum import sparse_weighted_sum, stack_lists  # noqa: E402
from .reductions import (  # noqa: E402
    Reducer,
    active_reducer,
    all_,
    amax_d,
    any_,
    any_flag,
    dot,
    mean_d,
    reduce_across,
    sqnorm,
)

__all__ = [
    "gram",
    "gram_screened",
    "kstats",
    "order_mean",
    "order_mean_screened",
    "closest_mean",
    "closest_mean_screened",
    "weighted_sum",
    "weighted_sum_screened",
    "finite_rows",
    "weighted_sum_chunked",
    "min_norm",
    "gc_project_",
    "gc_project",
    "gc_project_flat_",
    "lu_factor",
    "lu_factor_ex",
    "lu_solve",
    "arrowhead_solve",
    "fedecado_be_step",
    "BEStepWindow",
    "fused_sgd_step_",
    "corrected_sgd_step_",
    "gc_sgd_step_",
    "server_opt_step_",
    "dot",
    "sqnorm",
    "all_",
    "any_",
    "any_flag",
    "amax_d",
    "mean_d",
    "reduce_across",
    "active_reducer",
    "Reducer",
    "dequant_weighted_sum",
    "sparse_weighted_sum",
    "stack_lists",
    "add_gaussian_noise_",
    "weighted_sum_noised",
    "philox_normal",
]
