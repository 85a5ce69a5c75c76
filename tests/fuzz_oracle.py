"""Fuzz oracle: case generators and checkers for every public op in fedkernels.ops and every
registered aggregator (used by tests/test_fuzz.py and by the campaign runner ``python -m bench.fuzz``).

Each case is a small JSON dict (target, seed and structural choices). ``gen_case(rnd, target)``
draws one from a ``random.Random`` (tests/test_fuzz.py feeds it from hypothesis), ``execute(case)``
builds the tensors from the seed and checks the outcome:

* ``ok``: a correct result: compared with fedkernels.reference in float64 with a dtype-appropriate
  error bound (overflow to Inf allowed only where a partial sum exceeds the accumulation dtype's
  range; NaN/Inf inputs must give non-finite outputs exactly where the reference does), or for
  aggregators a float64 recomputation / invariants (finite output for finite input, shape and
  dtype preserved, global unchanged when every client is excluded);
* ``rejected``: a ValueError / TypeError (BadUpdateError is a ValueError) whose message names the
  op or one of its arguments;
* ``fail``: anything else (wrong result, another exception type, an unclear message). The campaign
  also counts a worker crash or a per-case timeout (a hang) as ``fail``.

The campaign (bench/fuzz.py) runs cases in a subprocess worker (restarted after a crash or a timeout).
"""

from __future__ import annotations

import math
import random
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch

from fedkernels import ops, reference
from fedkernels import algorithms
from fedkernels.algorithms import BadUpdateError
from fedkernels.flat import FlatSpec, ParamEntry

FLOATS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
INTS = {"i32": torch.int32, "i64": torch.int64}
DTYPES = {**FLOATS, **INTS}
FLOAT_NAMES = list(FLOATS)

# ops with a generator below; any other public callable in ops.__all__ is reported as not fuzzed
OP_TARGETS = [
    "gram",
    "gram_screened",
    "kstats",
    "order_mean",
    "order_mean_screened",
    "closest_mean",
    "closest_mean_screened",
    "weighted_sum",
    "weighted_sum_screened",
    "weighted_sum_chunked",
    "finite_rows",
    "min_norm",
    "gc_project_",
    "gc_project",
    "gc_project_flat_",
    "lu_factor",
    "lu_factor_ex",
    "lu_solve",
    "arrowhead_solve",
    "fedecado_be_step",
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
    "dequant_weighted_sum",
    "sparse_weighted_sum",
    "weighted_sum_noised",
    "add_gaussian_noise_",
    "philox_normal",
]

# public names of fedkernels.ops fuzzed through another target (BEStepWindow: fedecado_be_step's cases)
FUZZED_VIA = {"BEStepWindow": "fedecado_be_step", "stack_lists": "sparse_weighted_sum"}
# the selection ops, through the robust aggregators that call them (agg:median, agg:trimmed_mean, agg:bulyan)
FUZZED_VIA.update(
    dict.fromkeys(("order_mean", "order_mean_screened", "closest_mean", "closest_mean_screened"), "agg:median")
)

# public names of fedkernels.ops that are not data-path ops (the sharded-mode hooks)
NOT_DATA_OPS = {"reduce_across", "active_reducer", "Reducer"}


class Fail(AssertionError):
    """A wrong result (the checker's verdict)."""


# ---------------------------------------------------------------------------------------------
# case generation (structure only; tensors come from the seed in execute)
# ---------------------------------------------------------------------------------------------
def targets() -> List[str]:
    t = [f"op:{n}" for n in OP_TARGETS if callable(getattr(ops, n, None))]
    return t + [f"agg:{n}" for n in agg_names()]


def agg_names() -> List[str]:
    """Registered aggregators, one name per class (aliases dropped)."""
    seen, out = set(), []
    for n in algorithms.available():
        cls = algorithms.base._REGISTRY[n]
        if cls not in seen:
            seen.add(cls)
            out.append(cls.name)
    return sorted(out)


def unfuzzed_ops() -> List[str]:
    return [
        n
        for n in getattr(ops, "__all__", [])
        if callable(getattr(ops, n, None)) and n not in OP_TARGETS and n not in NOT_DATA_OPS and n not in FUZZED_VIA
    ]


def _K(rnd: random.Random, allow0=True) -> int:
    ks = ([0] if allow0 else []) + [1, 1, 2, 2, 3, 4, 5, 8, 17, 33, 64, 130, 300]
    return rnd.choice(ks)


def _d(rnd: random.Random, K: int) -> int:
    ds = [0, 1, 1, 2, 3, 5, 7, 16, 31, 64, 127, 257, 1000, 4097]
    d = rnd.choice(ds)
    while K * d > 400_000:
        d //= 4
    return d


def _dtype(rnd, invalid_p=0.05) -> str:
    if rnd.random() < invalid_p:
        return rnd.choice(list(INTS))
    return rnd.choice(FLOAT_NAMES)


VALUES = [
    "normal",
    "normal",
    "normal",
    "scaled",
    "huge",
    "denormal",
    "zeros",
    "dup_rows",
    "ints",
    "nan",
    "inf",
    "mixed",
]
LAYOUTS = ["contig", "contig", "colslice", "transposed", "rowstep", "expanded", "overlap", "stride0col"]


def gen_case(rnd: random.Random, target: Optional[str] = None) -> Dict[str, Any]:
    if target is None:
        target = rnd.choice(targets())
    c: Dict[str, Any] = {"target": target, "seed": rnd.randrange(2**31)}
    kind, name = target.split(":", 1)
    if kind == "agg":
        _gen_agg(rnd, c, name)
    else:
        globals()["_gen_" + name.rstrip("_") + ("_inplace" if name.endswith("_") else "")](rnd, c)
    return c


def _gen_matrix(rnd, c, allow0=True):
    c["K"] = _K(rnd, allow0)
    c["d"] = _d(rnd, c["K"])
    c["dtype"] = _dtype(rnd)
    c["values"] = rnd.choice(VALUES)
    c["layout"] = rnd.choice(LAYOUTS)
    c["bad_U"] = rnd.choice([None] * 20 + ["1d", "3d", "list", "none"])


def _gen_gram(rnd, c):
    _gen_matrix(rnd, c)
    c["rows"] = rnd.choice(
        [None, None, "subset", "dups", "empty", "tensor32", "bad_range", "neg", "float", "2d", "bool"]
    )
    c["nrows"] = rnd.choice([1, 2, 3, 7])


def _gen_weighted_sum(rnd, c):
    _gen_gram(rnd, c)
    c["coef"] = rnd.choice(["list", "f64", "f32", "int", "zeros", "big", "neg", "nan", "wrong_len", "2d", "inf"])
    c["base"] = rnd.choice([None, None, "ok", "noncontig", "expanded", "wrong_dtype", "wrong_len", "nan", "wide"])
    c["alpha"] = rnd.choice([1.0, 1.0, 0.0, -1.0, 0.37, 1e20, 3, True, float("nan"), "str", float("inf")])
    c["out"] = rnd.choice([None, None, "fresh", "base", "noncontig", "wrong_dtype", "wrong_len", "wide"])
    c["wide"] = rnd.choice(["fp32", "fp64"])


def _gen_weighted_sum_screened(rnd, c):
    _gen_weighted_sum(rnd, c)
    c["screened"] = True


def _gen_weighted_sum_chunked(rnd, c):
    _gen_gram(rnd, c)
    c["coef"] = rnd.choice(["list", "f64", "f32", "int", "zeros", "big", "neg", "nan", "wrong_len", "2d", "inf"])
    c["base"] = rnd.choice([None, None, "ok", "noncontig", "wrong_dtype", "wrong_len"])
    c["alpha"] = rnd.choice([1.0, 1.0, 0.0, -1.0, 0.37, 3, float("nan"), "str"])
    c["out_dtype"] = rnd.choice([None, None, "same", "fp32", "fp64", "i64"])
    c["chunk_cols"] = rnd.choice([1, 3, 64, 1 << 18, 1 << 18, 0, "x"])


_NOISE_SIGMAS = [0.0, 0.5, 3.0, 1e-30, 1e30, -1.0, float("nan"), float("inf"), "x", True]
_NOISE_INTS = [0, 1, 7, 2**32 + 5, 2**63 - 1, -1, 2**63, 1.5, True]


def _gen_noise_args(rnd, c):
    c["sigma"] = rnd.choice(_NOISE_SIGMAS[:3] * 3 + _NOISE_SIGMAS)
    c["nseed"] = rnd.choice(_NOISE_INTS[:5] * 3 + _NOISE_INTS)
    c["counter"] = rnd.choice(_NOISE_INTS[:5] * 3 + _NOISE_INTS)
    c["offset"] = rnd.choice([0, 0, 1, 8191, 2**40 + 1, -3])


def _gen_weighted_sum_noised(rnd, c):
    _gen_weighted_sum(rnd, c)
    c["out"] = None
    _gen_noise_args(rnd, c)


def _gen_add_gaussian_noise_inplace(rnd, c):
    c["dtype"] = _dtype(rnd)
    c["n"] = rnd.choice([0, 1, 2, 3, 17, 256, 1001])
    c["layout"] = rnd.choice(["contig", "contig", "2d", "noncontig"])
    _gen_noise_args(rnd, c)


def _gen_philox_normal(rnd, c):
    c["n"] = rnd.choice([0, 1, 2, 3, 64, 257, -1])
    _gen_noise_args(rnd, c)


def _valid_noise_args(c, sigma=True):
    ints_ok = all(
        isinstance(c[k], int) and not isinstance(c[k], bool) and 0 <= c[k] < 2**63
        for k in ("nseed", "counter", "offset")
    )
    s = c["sigma"]
    return ints_ok and (
        not sigma or (isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0)
    )


def _gen_finite_rows(rnd, c):
    _gen_matrix(rnd, c)


def _gen_gram_screened(rnd, c):
    _gen_matrix(rnd, c)


def _gen_kstats(rnd, c):
    _gen_matrix(rnd, c)
    c["coef"] = rnd.choice(["list", "f64", "f64", "f32", "int", "zeros", "big", "neg", "nan", "wrong_len", "2d", "inf"])


def _gen_select_rows(rnd, c):
    _gen_gram(rnd, c)
    if rnd.random() < 0.6:  # mostly valid rows: the selection itself is the target
        c["rows"] = rnd.choice([None, None, "subset", "dups", "tensor32"])


def _gen_order_mean(rnd, c):
    _gen_select_rows(rnd, c)
    c["bounds"] = rnd.choice(
        [
            "median",
            "median",
            "trim",
            "trim",
            "min",
            "max",
            "all",
            "random",
            "lo_eq_hi",
            "hi_gt_k",
            "neg",
            "float",
            "bool",
        ]
    )
    c["beta"] = rnd.choice([0.0, 0.1, 0.2, 0.3, 0.45])


def _gen_order_mean_screened(rnd, c):
    _gen_order_mean(rnd, c)


def _gen_closest_mean(rnd, c):
    _gen_select_rows(rnd, c)
    c["bounds"] = rnd.choice(["one", "half", "all", "bulyan", "bulyan", "zero", "gt_k", "float"])


def _gen_closest_mean_screened(rnd, c):
    _gen_closest_mean(rnd, c)


def _gen_min_norm(rnd, c):
    c["K"] = rnd.choice([0, 1, 2, 2, 3, 4, 5, 8, 13, 30, 64])
    c["gkind"] = rnd.choice(
        [
            "psd",
            "psd",
            "psd_lowrank",
            "dups",
            "zero_rows",
            "psd_scaled",
            "indefinite",
            "neg_diag",
            "nonsym",
            "identity",
            "zeros",
            "nan",
            "inf",
            "nonsquare",
            "int",
            "1d",
        ]
    )
    c["scale_exp"] = rnd.choice([0, 0, -300, -150, -30, 30, 150, 300])
    c["dtype"] = rnd.choice(FLOAT_NAMES)
    c["transposed"] = rnd.random() < 0.2
    c["method"] = rnd.choice(list(ops.MIN_NORM_METHODS) + ["bogus"] * (rnd.random() < 0.05))
    c["init"] = rnd.choice(list(ops.MIN_NORM_INITS) + ["bogus"] * (rnd.random() < 0.05))
    c["max_iter"] = rnd.choice([0, 1, 5, 100, 1000, 1000, -1, 2.5, True])
    c["tol"] = rnd.choice([1e-12, 1e-12, 1e-6, 0.0, -1.0, float("nan")])
    c["tol_abs"] = rnd.choice([1e-15, 1e-15, 0.0, float("inf")])
    c["polish"] = rnd.choice([True, False])
    c["lam0"] = rnd.choice([None, None, None, "ok", "wrong_len", "neg", "zero", "nan"])


def _gen_gc_tensors(rnd, c):
    n = rnd.choice([0, 1, 1, 2, 3, 5])
    ts = []
    for _ in range(n):
        nd = rnd.choice([0, 1, 1, 2, 2, 3, 4, 4, 5])
        shape = [
            rnd.choice([0, 1, 1, 2, 3, 5, 8, 33]) if rnd.random() < 0.15 else rnd.choice([1, 2, 3, 5, 8, 16, 33])
            for _ in range(nd)
        ]
        while math.prod(shape) > 100_000:
            shape[shape.index(max(shape))] //= 2
        ts.append(
            {
                "shape": shape,
                "dtype": _dtype(rnd, 0.03),
                "values": rnd.choice(VALUES),
                "layout": rnd.choice(
                    ["contig", "contig", "channels_last", "transposed", "sliced", "expanded", "dup_prev"]
                ),
            }
        )
    c["tensors"] = ts
    c["vector_policy"] = rnd.choice(
        ["skip", "center", "center", "skip", "bogus"] if rnd.random() < 0.1 else ["skip", "center"]
    )
    c["min_fanin"] = rnd.choice([1, 2, 2, 2, 3, 17, 0, 1.5, True] if rnd.random() < 0.15 else [1, 2, 2, 3, 17])
    c["bad_list"] = rnd.choice([None] * 25 + ["tensor", "nontensor_item", "mixed_device_none"])


def _gen_gc_project(rnd, c):
    _gen_gc_tensors(rnd, c)


def _gen_gc_project_inplace(rnd, c):
    _gen_gc_tensors(rnd, c)


def _gen_gc_project_flat_inplace(rnd, c):
    c["d"] = rnd.choice([0, 1, 2, 5, 12, 31, 100, 1000])
    c["K"] = rnd.choice([None, None, 1, 2, 5])
    c["dtype"] = _dtype(rnd, 0.0)
    c["values"] = rnd.choice(VALUES)
    c["vector_policy"] = rnd.choice(["skip", "center"])
    c["min_fanin"] = rnd.choice([1, 2, 3])
    c["select"] = rnd.choice([None, "no_bias"])
    c["bad"] = rnd.choice([None] * 10 + ["wrong_d", "strided", "3d"])


def _gen_lu_factor(rnd, c):
    c["n"] = rnd.choice([0, 1, 2, 3, 5, 8, 17, 40])
    c["akind"] = rnd.choice(
        [
            "random",
            "random",
            "diag_dom",
            "singular",
            "zero",
            "nan",
            "nonsquare",
            "int",
            "near_singular",
            "huge",
            "denormal",
        ]
    )
    c["dtype"] = rnd.choice(FLOAT_NAMES)
    c["nrhs"] = rnd.choice([None, 0, 1, 3, 1000])
    c["transposed"] = rnd.random() < 0.2


def _gen_lu_solve(rnd, c):
    _gen_lu_factor(rnd, c)


def _gen_lu_factor_ex(rnd, c):
    _gen_lu_factor(rnd, c)


def _gen_arrowhead_solve(rnd, c):
    c["K"] = rnd.choice([0, 1, 2, 3, 8, 33])
    c["m"] = rnd.choice([0, 1, 2, 7, 100, 1001])
    c["dtype"] = rnd.choice(["fp32", "fp64", "fp32", "fp64", "fp16", "bf16", "i64"])
    c["akind"] = rnd.choice(["fedecado", "fedecado", "random", "zero_a", "nan", "wrong_len", "huge"])
    c["layout"] = rnd.choice(["contig", "contig", "transposed", "colslice"])


def _gen_fedecado_be_step(rnd, c):
    c["K"] = rnd.choice([0, 1, 2, 3, 5, 17])
    c["d"] = rnd.choice([0, 1, 2, 7, 64, 1001])
    c["dtype"] = rnd.choice(["fp32", "fp64", "fp32", "fp64", "fp16", "bf16", "i64"])
    c["kind"] = rnd.choice(
        ["ok", "ok", "ok", "no_soff", "nan", "huge", "bad_dt", "neg_inv_g", "wrong_shape", "wrong_theta_len"]
    )
    c["layout"] = rnd.choice(["contig", "contig", "transposed", "colslice"])
    c["use_out"] = rnd.choice([False, True])
    c["window"] = rnd.choice([False, True])  # through ops.BEStepWindow (two steps), not the single call


def _gen_sgd(rnd, c):
    n = rnd.choice([0, 1, 2, 3])
    c["params"] = [
        {
            "shape": [rnd.choice([1, 2, 3, 5, 16]) for _ in range(rnd.choice([0, 1, 2, 4]))],
            "dtype": _dtype(rnd, 0.03),
            "layout": rnd.choice(["contig", "contig", "transposed", "sliced"]),
        }
        for _ in range(n)
    ]
    c["values"] = rnd.choice(["normal", "normal", "scaled", "zeros", "nan", "denormal"])
    c["lr"] = rnd.choice([0.1, 0.01, 0.0, 1.0, -0.5, float("nan"), "x"])
    c["momentum"] = rnd.choice([0.0, 0.0, 0.9, 0.5, -0.1])
    c["weight_decay"] = rnd.choice([0.0, 0.0, 1e-4, 0.1])
    c["first_step"] = rnd.choice([False, True])
    c["corr"] = rnd.choice([None, None, "add", "sub", "both", "some_none", "wrong_shape"])
    c["gc"] = rnd.choice([None, True, False, "per", "bad_len"])
    c["vector_policy"] = rnd.choice(["skip", "center"])
    c["min_fanin"] = rnd.choice([1, 2, 3])
    c["bad"] = rnd.choice([None] * 12 + ["grads_len", "grad_dtype", "no_bufs", "tensor"])


def _gen_fused_sgd_step(rnd, c):
    _gen_sgd(rnd, c)


def _gen_fused_sgd_step_inplace(rnd, c):
    _gen_sgd(rnd, c)


def _gen_corrected_sgd_step_inplace(rnd, c):
    _gen_sgd(rnd, c)
    c["corr"] = rnd.choice(["c_only", "c_ci", "subset"])
    c["gc"] = None


def _gen_gc_sgd_step_inplace(rnd, c):
    _gen_sgd(rnd, c)
    c["corr"] = None
    if c["gc"] in (None, "bad_len"):
        c["gc"] = True


def _gen_server_opt_step_inplace(rnd, c):
    c["d"] = rnd.choice([0, 1, 2, 7, 64, 1001, 4097])
    c["dtype"] = rnd.choice(["fp32", "fp32", "fp64", "fp64", "fp16", "bf16", "i64"])
    c["state"] = rnd.choice(["fp32", "fp32", "fp64", "fp16"])
    c["rule"] = rnd.choice(["adam", "yogi", "adagrad", "adam", "yogi", "adagrad", "sgd"])
    c["values"] = rnd.choice(
        ["normal", "normal", "normal", "scaled", "zeros", "ints", "denormal", "huge", "nan", "inf"]
    )
    c["layout"] = rnd.choice(["contig", "contig", "strided"])
    c["from_model"] = rnd.choice([False, True])
    c["lr"] = rnd.choice([0.1, 0.01, 0.0, -0.5, 1e3, float("nan")])
    c["tau"] = rnd.choice([1e-9, 1e-3, 1e-3, 0.0, -1.0])
    c["beta_1"] = rnd.choice([0.9, 0.9, 0.0, 0.5, 1.0, 1.5])
    c["beta_2"] = rnd.choice([0.99, 0.99, 0.0, 0.9, 1.0, -0.1])
    c["bad"] = rnd.choice([None] * 10 + ["len", "alias", "io_dtype"])


def _gen_dvec(rnd, c):
    c["shape"] = rnd.choice([[0], [1], [7], [1000], [3, 5], [2, 0], [4, 33]])
    c["dtype"] = rnd.choice(FLOAT_NAMES + ["i64", "bool"])
    c["values"] = rnd.choice(["normal", "normal", "zeros", "nan", "inf", "huge", "scaled"])
    c["mismatch"] = rnd.random() < 0.1
    c["nontensor"] = rnd.random() < 0.05


def _gen_dvec_float(rnd, c):  # amax_d / mean_d: float d-reductions (no dtype validation by design)
    _gen_dvec(rnd, c)
    c["dtype"] = rnd.choice(FLOAT_NAMES)


for _n in ("dot", "sqnorm", "all", "any"):
    globals()["_gen_" + _n + ("_inplace" if _n in ("all", "any") else "")] = _gen_dvec
_gen_any_flag = _gen_dvec
_gen_amax_d = _gen_mean_d = _gen_dvec_float


# aggregators -----------------------------------------------------------------------------------
AGG_MUTATIONS = [None] * 12 + [
    "nan_rows",
    "inf_rows",
    "all_bad",
    "wrong_d",
    "list_bad_len",
    "list_nontensor",
    "dtype_mismatch",
    "int_dtype",
    "n_len",
    "n_neg",
    "n_zero",
    "n_nan",
    "n_none",
    "n_str",
    "ids_len",
    "ids_dup",
    "ids_range",
    "ids_str",
    "ids_float",
    "payload_len",
    "payload_missing",
    "payload_nan",
    "global_nan",
    "global_2d",
    "global_list",
    "updates_none",
    "K0",
]


def _gen_agg(rnd, c, name):
    c["K"] = rnd.choice([1, 1, 2, 2, 3, 4, 5, 8, 16, 40])
    c["N"] = c["K"] + rnd.choice([0, 0, 1, 3, 10])
    c["d"] = rnd.choice([0, 1, 2, 3, 7, 16, 33, 100, 513, 2000]) if rnd.random() > 0.02 else 0
    c["dtype"] = rnd.choice(["fp32", "fp32", "fp64", "fp16", "bf16"])
    c["rounds"] = rnd.choice([1, 1, 2, 3])
    c["values"] = rnd.choice(
        ["normal", "normal", "normal", "scaled", "zeros", "dup_rows", "ints", "denormal", "tiny_big"]
    )
    c["layout"] = rnd.choice(["contig", "contig", "contig", "transposed", "colslice", "expanded", "rowstep"])
    c["policy"] = rnd.choice(["raise", "exclude"])
    c["server_lr"] = rnd.choice([1.0, 1.0, 0.5, 2.0])
    c["mutation"] = rnd.choice(AGG_MUTATIONS)
    c["opts"] = rnd.randrange(4)  # per-method option set (see _agg_options)


# ---------------------------------------------------------------------------------------------
# tensor construction
# ---------------------------------------------------------------------------------------------
def _finfo(dt):
    return torch.finfo(dt) if dt.is_floating_point else None


def _values(g: torch.Generator, shape, dtype, kind: str) -> torch.Tensor:
    """A fp64 tensor of the given kind, cast to dtype (casting may overflow fp16 to Inf: intended)."""
    shape = tuple(shape)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    n = x.numel()
    fmax = _finfo(dtype).max if dtype.is_floating_point else 2.0**30
    tiny = _finfo(dtype).tiny if dtype.is_floating_point else 1.0
    if kind == "scaled":
        e = float(torch.randint(-30, 31, (1,), generator=g))
        x = x * 10.0**e
    elif kind == "huge":
        x = x.sign() * fmax * (0.25 + 0.7 * torch.rand(shape, generator=g, dtype=torch.float64))
    elif kind == "denormal":
        x = x * tiny * 0.25
    elif kind == "zeros":
        x = torch.zeros(shape, dtype=torch.float64)
    elif kind == "dup_rows" and len(shape) >= 2 and shape[0] > 0:
        x = x[:1].expand(shape).clone()
        if shape[0] > 2:
            x[-1] = 0
    elif kind == "ints":
        x = torch.randint(-5, 6, shape, generator=g).to(torch.float64)
    elif kind == "tiny_big" and len(shape) >= 2 and shape[0] > 1:
        x[0] *= 1e-6
        x[-1] *= 1e3
    elif kind in ("nan", "inf", "mixed") and n:
        flat = x.view(-1)
        m = max(1, n // 17)
        idx = torch.randint(0, n, (m,), generator=g)
        if kind == "nan":
            flat[idx] = float("nan")
        elif kind == "inf":
            flat[idx] = float("inf") * torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0).double()
        else:
            flat[idx] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e300], dtype=torch.float64)[
                torch.randint(0, 4, (m,), generator=g)
            ]
    if dtype.is_floating_point:
        return x.to(dtype)
    return x.clamp(-1e6, 1e6).round().to(dtype)


def _layout(g, X: torch.Tensor, layout: str) -> torch.Tensor:
    """The same [K, d] values in another memory layout (for expanded/overlap: different values)."""
    K, d = X.shape
    if layout == "colslice":
        big = torch.zeros(K, d + 5, dtype=X.dtype)
        big[:, 2 : 2 + d] = X
        return big[:, 2 : 2 + d]
    if layout == "transposed":
        return X.t().contiguous().t()
    if layout == "rowstep":
        big = torch.zeros(2 * K, d, dtype=X.dtype)
        big[::2] = X
        return big[::2]
    if layout == "expanded" and K > 0:
        return X[:1].expand(K, d)
    if layout == "overlap" and K > 0 and d > 1:
        s = max(1, d // 3)
        store = torch.zeros(s * (K - 1) + d, dtype=X.dtype)
        src = X.reshape(-1)[: store.numel()]
        store[: src.numel()] = src
        return store.as_strided((K, d), (s, 1))
    if layout == "stride0col" and K > 0 and d > 0:
        return X[:, :1].expand(K, d)
    return X


def _matrix_input(g, c) -> Any:
    dt = DTYPES[c["dtype"]]
    X = _layout(g, _values(g, (c["K"], c["d"]), dt, c["values"]), c["layout"])
    bad = c.get("bad_U")
    if bad == "1d":
        return X.reshape(-1)
    if bad == "3d":
        return X.reshape(1, c["K"], c["d"])
    if bad == "list":
        return X.tolist()
    if bad == "none":
        return None
    return X


def _rows_arg(g, c, K):
    r = c.get("rows")
    if r is None:
        return None
    n = c["nrows"]
    if r == "subset":
        return torch.randperm(max(K, 1), generator=g)[: min(n, K)].tolist() if K else []
    if r == "dups":
        return [0] * n if K else [0]
    if r == "empty":
        return []
    if r == "tensor32":
        return torch.arange(K, dtype=torch.int32).flip(0)
    if r == "bad_range":
        return [K]
    if r == "neg":
        return [-1]
    if r == "float":
        return [0.0]
    if r == "2d":
        return [[0]]
    if r == "bool":
        return torch.ones(max(K, 1), dtype=torch.bool)
    raise KeyError(r)


# ---------------------------------------------------------------------------------------------
# checking helpers
# ---------------------------------------------------------------------------------------------
def _acc_dtype(dt):
    return torch.float64 if dt == torch.float64 else torch.float32


def _eps(dt):
    return torch.finfo(dt).eps


def _check_close(name, got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, may_overflow: torch.Tensor):
    """got (any dtype) vs ref (fp64): non-finite exactly where ref is non-finite, except where
    ``may_overflow`` (a partial sum beyond the accumulation dtype's range) allows Inf/NaN."""
    g64 = got.detach().to(torch.float64)
    if g64.shape != ref.shape:
        raise Fail(f"{name}: shape {tuple(g64.shape)} != reference {tuple(ref.shape)}")
    rf = torch.isfinite(ref)
    gf = torch.isfinite(g64)
    bad = rf & ~gf & ~may_overflow
    if bool(bad.any()):
        i = int(torch.nonzero(bad.reshape(-1))[0])
        raise Fail(
            f"{name}: non-finite output {g64.reshape(-1)[i].item()} where the reference is finite "
            f"{ref.reshape(-1)[i].item()} (flat index {i})"
        )
    bad = ~rf & gf & ~(may_overflow & ~torch.isnan(ref))  # the fp64 reference itself may overflow
    if bool(bad.any()):
        i = int(torch.nonzero(bad.reshape(-1))[0])
        raise Fail(
            f"{name}: finite output {g64.reshape(-1)[i].item()} where the reference is "
            f"{ref.reshape(-1)[i].item()} (NaN/Inf must propagate; flat index {i})"
        )
    both = rf & gf
    err = (g64 - ref).abs()
    bad = both & (err > tol)
    if bool(bad.any()):
        i = int(torch.nonzero(bad.reshape(-1))[0])
        raise Fail(
            f"{name}: |got - ref| = {err.reshape(-1)[i].item():.3e} > tol {tol.reshape(-1)[i].item():.3e} "
            f"(got {g64.reshape(-1)[i].item()!r}, ref {ref.reshape(-1)[i].item()!r}, flat index {i})"
        )


def _clean_rejection(e: BaseException, names: List[str]) -> Optional[str]:
    """None when e is a documented rejection whose message names the op/argument, else why not."""
    if not isinstance(e, (ValueError, TypeError)):
        return f"undocumented exception {type(e).__name__}: {e}"
    msg = str(e)
    if not any(n in msg for n in names):
        return f"{type(e).__name__} message names none of {names}: {msg!r}"
    return None


# ---------------------------------------------------------------------------------------------
# op runners: return "ok" or raise Fail; exceptions from the op itself are classified by execute
# ---------------------------------------------------------------------------------------------
def _run_gram(g, c):
    U = _matrix_input(g, c)
    rows = _rows_arg(g, c, c["K"])
    out = ops.gram(U, rows)
    if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.dtype.is_floating_point:
        raise Fail(f"gram accepted an invalid U ({c.get('bad_U') or c['dtype']})")
    ref = reference.gram(U, rows)
    if out.dtype != torch.float64:
        raise Fail(f"gram: output dtype {out.dtype}, expected float64")
    U64 = U.to(torch.float64)
    nrm = U64.abs()
    r = reference._rows_idx(rows, U.size(0), U.device)
    S = nrm[r] @ nrm.T  # sum |u_ik||u_jk|: the rounding scale
    tol = 4 * (c["d"] + 2) * _eps(torch.float64) * S + 1e-300
    may = ~torch.isfinite(S) | (S > 1e300)
    _check_close("gram", out, ref, tol, may)
    return "ok"


def _coef_arg(g, c, n):
    k = c["coef"]
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if k == "list":
        return x.tolist()
    if k == "f64":
        return x
    if k == "f32":
        return x.float()
    if k == "int":
        return torch.randint(-3, 4, (n,), generator=g)
    if k == "zeros":
        return torch.zeros(n, dtype=torch.float64)
    if k == "big":
        return x * 1e30
    if k == "neg":
        return -x.abs()
    if k == "nan":
        return torch.full((n,), float("nan"), dtype=torch.float64) if n else [float("nan")]
    if k == "inf":
        return torch.full((n,), float("inf"), dtype=torch.float64) if n else [float("inf")]
    if k == "wrong_len":
        return torch.ones(n + 1, dtype=torch.float64)
    if k == "2d":
        return torch.ones(n, 1, dtype=torch.float64)
    raise KeyError(k)


# weighted_sum's result (out, base): U's dtype, or a wider fp32/fp64 for a half-precision U (accumulated in it)
_WIDER_RESULT = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64)}


def _result_dtype_arg(dt, kind, wide):
    """The dtype of a "wide" (fp32/fp64: valid for a half U, not for fp32/fp64) or "wrong_dtype" base/out."""
    if kind == "wide":
        return DTYPES[wide]
    return {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16, torch.float64: torch.float32}.get(
        dt, torch.float64
    )


def _wsum_inputs(g, c):
    """(U, K, d, rows, n, coef, dt) of a weighted-sum case: the matrix, its rows and their coefficients."""
    U = _matrix_input(g, c)
    K, d = c["K"], c["d"]
    rows = _rows_arg(g, c, K)
    n = K if rows is None else len(rows) if not isinstance(rows, torch.Tensor) else rows.numel()
    return U, K, d, rows, n, _coef_arg(g, c, n), DTYPES[c["dtype"]]


def _run_weighted_sum(g, c):
    U, K, d, rows, n, coef, dt = _wsum_inputs(g, c)
    base = None
    bk = c["base"]
    if bk is not None:
        base = _values(g, (d,), dt, "normal")
        if bk in ("wrong_dtype", "wide"):
            base = base.to(_result_dtype_arg(dt, bk, c.get("wide", "fp64")))
        if bk == "noncontig":
            b2 = torch.zeros(2 * d, dtype=dt)
            b2[::2] = base
            base = b2[::2]
        elif bk == "expanded":
            base = base[:1].expand(d) if d else base
        elif bk == "wrong_len":
            base = torch.zeros(d + 1, dtype=dt)
        elif bk == "nan" and d and dt.is_floating_point:
            base = base.clone()
            base[0] = float("nan")
    out = None
    ok_ = c["out"]
    if ok_ == "fresh":
        out = torch.full((d,), 7.0, dtype=dt) if dt.is_floating_point else torch.zeros(d, dtype=dt)
    elif ok_ == "base":
        out = base
    elif ok_ == "noncontig":
        out = torch.zeros(2 * d + 2, dtype=dt)[::2][:d] if d > 1 else torch.zeros(4, dtype=dt)[::2][:d].t()
        if out.is_contiguous():  # a 0/1-element strided view is contiguous: nothing to test
            out = torch.zeros(2 * 2, dtype=dt)[::2]
    elif ok_ in ("wrong_dtype", "wide"):
        out = torch.zeros(d, dtype=_result_dtype_arg(dt, ok_, c.get("wide", "fp64")))
    elif ok_ == "wrong_len":
        out = torch.zeros(d + 1, dtype=dt)
    alpha = c["alpha"]
    base0 = None if base is None else base.clone()
    if c.get("screened"):  # weighted_sum_screened: the same sum, and the rows' finite flags
        res, okf = ops.weighted_sum_screened(U, coef, base=base, alpha=alpha, rows=rows, out=out)
    else:
        res = ops.weighted_sum(U, coef, base=base, alpha=alpha, rows=rows, out=out)
    # the call succeeded: the inputs must have been valid
    if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.dtype.is_floating_point:
        raise Fail("weighted_sum accepted an invalid U")
    if isinstance(alpha, str) or (isinstance(alpha, float) and not math.isfinite(alpha)):
        raise Fail(f"weighted_sum accepted alpha={alpha!r}")
    c64 = torch.as_tensor(coef, dtype=torch.float64)
    if c64.dim() != 1 or c64.numel() != n or not bool(torch.isfinite(c64).all()):
        raise Fail(f"weighted_sum accepted coef of shape {tuple(c64.shape)} / non-finite values")
    if ok_ is not None and out is not None and res is not out:
        raise Fail("weighted_sum did not return out")
    rdt = out.dtype if out is not None else base.dtype if base is not None else dt
    if rdt not in (dt,) + _WIDER_RESULT.get(dt, ()) or (base is not None and base.dtype != rdt):
        raise Fail(f"weighted_sum accepted a {rdt} result (base {None if base is None else base.dtype}) for a {dt} U")
    if res.dtype != rdt or res.shape != (d,):
        raise Fail(f"weighted_sum: result {res.dtype} {tuple(res.shape)}, expected {rdt} ({d},)")
    ref = reference.weighted_sum(U, c64, base=base0, alpha=float(alpha), rows=rows)
    r = reference._rows_idx(rows, K, U.device)
    if c.get("screened"):
        want = reference.weighted_sum_screened(U, c64, base=base0, alpha=float(alpha), rows=r)[1]
        if okf.dtype != torch.bool or not torch.equal(okf.cpu(), want.cpu()):
            raise Fail(f"weighted_sum_screened: flags {okf.tolist()}, expected {want.tolist()}")
        plain = ops.weighted_sum(
            U, coef, base=base0, alpha=alpha, rows=rows, out=None if out is None else torch.empty(d, dtype=rdt)
        )
        if not torch.equal(res.isnan(), plain.isnan()) or not torch.equal(res.nan_to_num(), plain.nan_to_num()):
            raise Fail("weighted_sum_screened: the sum differs from weighted_sum's")
    acc = _acc_dtype(rdt)
    S = (
        abs(float(alpha)) * (c64.abs()[:, None] * U.to(torch.float64).abs()[r]).sum(0)
        if n
        else torch.zeros(d, dtype=torch.float64)
    )
    if base0 is not None:
        S = S + base0.to(torch.float64).abs()
    tol = (n + 6) * 2 * _eps(acc) * S + 2 * _eps(rdt) * ref.abs().nan_to_num(0, 0, 0) + (n + 2) * torch.finfo(rdt).tiny
    amax, omax = torch.finfo(acc).max, torch.finfo(rdt).max
    may = ~torch.isfinite(S) | (S * 1.001 >= amax) | (ref.abs() * 1.001 >= omax)
    _check_close("weighted_sum", res, ref, tol, may)
    return "ok"


_run_weighted_sum_screened = _run_weighted_sum


def _run_weighted_sum_chunked(g, c):
    U = _matrix_input(g, c)
    K, d = c["K"], c["d"]
    rows = _rows_arg(g, c, K)
    n = K if rows is None else len(rows) if not isinstance(rows, torch.Tensor) else rows.numel()
    coef = _coef_arg(g, c, n)
    dt = DTYPES[c["dtype"]]
    odn = c["out_dtype"]
    odt = None if odn is None else dt if odn == "same" else DTYPES[odn]
    rdt = odt if odt is not None else dt  # the result's dtype when base is None
    base = None
    bk = c["base"]
    if bk is not None:
        bdt = rdt if bk != "wrong_dtype" else (torch.float64 if rdt != torch.float64 else torch.float32)
        base = (
            _values(g, (d + (bk == "wrong_len"),), bdt, "normal")
            if bdt.is_floating_point
            else torch.zeros(d, dtype=bdt)
        )
        if bk == "noncontig":
            b2 = torch.zeros(2 * d, dtype=bdt)
            b2[::2] = base
            base = b2[::2]
    alpha = c["alpha"]
    res = ops.weighted_sum_chunked(
        U, coef, base=base, alpha=alpha, rows=rows, out_dtype=odt, chunk_cols=c["chunk_cols"]
    )
    if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.dtype.is_floating_point:
        raise Fail("weighted_sum_chunked accepted an invalid M")
    if isinstance(alpha, str) or (isinstance(alpha, float) and not math.isfinite(alpha)):
        raise Fail(f"weighted_sum_chunked accepted alpha={alpha!r}")
    if not isinstance(c["chunk_cols"], int) or c["chunk_cols"] < 1:
        raise Fail(f"weighted_sum_chunked accepted chunk_cols={c['chunk_cols']!r}")
    c64 = torch.as_tensor(coef, dtype=torch.float64)
    if c64.dim() != 1 or c64.numel() != n or not bool(torch.isfinite(c64).all()):
        raise Fail(f"weighted_sum_chunked accepted coef of shape {tuple(c64.shape)} / non-finite values")
    rdt = base.dtype if odt is None and base is not None else rdt
    if res.dtype != rdt or res.shape != (d,):
        raise Fail(f"weighted_sum_chunked: result {res.dtype} {tuple(res.shape)}, expected {rdt} ({d},)")
    # the same sum as weighted_sum on the converted selected rows (both round M to the result dtype first)
    r = reference._rows_idx(rows, K, U.device)
    Uc = U[r].to(rdt)
    ref = reference.weighted_sum(Uc, c64, base=base, alpha=float(alpha))
    acc = _acc_dtype(rdt)
    S = (
        abs(float(alpha)) * (c64.abs()[:, None] * Uc.to(torch.float64).abs()).sum(0)
        if n
        else torch.zeros(d, dtype=torch.float64)
    )
    if base is not None:
        S = S + base.to(torch.float64).abs()
    tol = (n + 6) * 2 * _eps(acc) * S + 2 * _eps(rdt) * ref.abs().nan_to_num(0, 0, 0) + (n + 2) * torch.finfo(rdt).tiny
    amax, omax = torch.finfo(acc).max, torch.finfo(rdt).max
    may = ~torch.isfinite(S) | (S * 1.001 >= amax) | (ref.abs() * 1.001 >= omax)
    # a NaN of the reference from its own overflow (Inf - Inf of finite inputs, in its order of the sum) is
    # an overflow, not a NaN to propagate: another order may stay finite or give Inf
    finite_cols = torch.isfinite(Uc).all(0) if n else torch.ones(d, dtype=torch.bool)
    if base is not None:
        finite_cols &= torch.isfinite(base)
    ref = torch.where(torch.isnan(ref) & may & finite_cols, torch.full_like(ref, math.inf), ref)
    _check_close("weighted_sum_chunked", res, ref, tol, may)
    return "ok"


def _run_weighted_sum_noised(g, c):
    """weighted_sum's arguments plus the noise: sigma = 0 gives weighted_sum's bits; otherwise each column
    is weighted_sum's value plus sigma N(seed, counter, offset + j) within the two roundings of the noised
    write (the noise rounded to the accumulation type, the sum to the result's dtype); invalid noise
    arguments are refused."""
    U, K, d, rows, n, coef, dt = _wsum_inputs(g, c)
    base = None
    if c["base"] == "ok" and dt.is_floating_point:
        base = _values(g, (d,), dt, "normal")
    try:
        plain = ops.weighted_sum(U, coef, base=base, alpha=c["alpha"], rows=rows)
    except (ValueError, TypeError):
        plain = None
    res = ops.weighted_sum_noised(
        U, coef, base, c["alpha"], rows, sigma=c["sigma"], seed=c["nseed"], counter=c["counter"], offset=c["offset"]
    )
    if plain is None:
        raise Fail("weighted_sum_noised accepted arguments that weighted_sum refuses")
    if not _valid_noise_args(c):
        raise Fail(
            f"weighted_sum_noised accepted sigma={c['sigma']!r} seed={c['nseed']!r} "
            f"counter={c['counter']!r} offset={c['offset']!r}"
        )
    if res.dtype != plain.dtype or res.shape != plain.shape:
        raise Fail(f"weighted_sum_noised: result {res.dtype} {tuple(res.shape)} != weighted_sum's")
    if float(c["sigma"]) == 0.0:
        if not torch.equal(res.isnan(), plain.isnan()) or not torch.equal(res.nan_to_num(), plain.nan_to_num()):
            raise Fail("weighted_sum_noised with sigma = 0 differs from weighted_sum")
        return "ok"
    z = float(c["sigma"]) * ops.philox_normal(d, c["nseed"], c["counter"], c["offset"])
    want = plain.to(torch.float64) + z
    tol = (
        2 * (_eps(_acc_dtype(res.dtype)) + _eps(res.dtype)) * (plain.to(torch.float64).abs() + z.abs())
        + torch.finfo(res.dtype).tiny
    )
    may = ~torch.isfinite(want) | (want.abs() * 1.001 >= torch.finfo(res.dtype).max)
    _check_close("weighted_sum_noised", res, want, tol, may)
    return "ok"


def _run_add_gaussian_noise_(g, c):
    """The same bits as reference._noise_like (the normals and the rounding rule), or a refusal."""
    dt = DTYPES[c["dtype"]]
    n = c["n"]
    x = _values(g, (n,), dt, "normal") if dt.is_floating_point else torch.zeros(n, dtype=dt)
    if c["layout"] == "2d" and n % 2 == 0 and n:
        x = x.reshape(2, n // 2)
    elif c["layout"] == "noncontig" and n > 1:
        x = torch.stack([x, x], 1)[:, 0]
    x0 = x.clone()
    res = ops.add_gaussian_noise_(x, c["sigma"], c["nseed"], c["counter"], c["offset"])
    if not dt.is_floating_point or not x.is_contiguous() or not _valid_noise_args(c):
        raise Fail(
            f"add_gaussian_noise_ accepted {dt} contiguous={x.is_contiguous()} sigma={c['sigma']!r} "
            f"seed={c['nseed']!r} counter={c['counter']!r} offset={c['offset']!r}"
        )
    if res is not x:
        raise Fail("add_gaussian_noise_ did not return x")
    flat = x0.reshape(-1)
    nz = reference.philox_normal(flat.numel(), c["nseed"], c["counter"], c["offset"])
    s = float(c["sigma"])
    if dt == torch.float64:
        want = torch.tensor([reference._fma(s, a, b) for a, b in zip(nz.tolist(), flat.tolist())], dtype=dt)
    else:
        want = (flat.float() + (s * nz).float()).to(dt)
    got = x.reshape(-1)
    if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(got.nan_to_num(), want.nan_to_num()):
        raise Fail("add_gaussian_noise_: bits differ from the reference")
    return "ok"


def _run_philox_normal(g, c):
    res = ops.philox_normal(c["n"], c["nseed"], c["counter"], c["offset"])
    if c["n"] < 0 or not _valid_noise_args(c, sigma=False):
        raise Fail(f"philox_normal accepted n={c['n']} seed={c['nseed']!r} counter={c['counter']!r} j0={c['offset']!r}")
    if not torch.equal(res, reference.philox_normal(c["n"], c["nseed"], c["counter"], c["offset"])):
        raise Fail("philox_normal: bits differ from the reference")
    return "ok"


def _run_finite_rows(g, c):
    U = _matrix_input(g, c)
    out = ops.finite_rows(U)
    if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.dtype.is_floating_point:
        raise Fail("finite_rows accepted an invalid U")
    ref = reference.finite_rows(U)
    if out.dtype != torch.bool or not torch.equal(out, ref):
        raise Fail(f"finite_rows: {out.tolist()[:8]} != reference {ref.tolist()[:8]}")
    return "ok"


def _run_kstats(g, c):
    """(dot, nsq, nbar) vs the two-pass float64 reference (the mean, then the rows against it) at the
    rounding scale of their sums of magnitudes; ok = the reference's row flags exactly (every dtype)."""
    U = _matrix_input(g, c)
    p = _coef_arg(g, c, c["K"])
    dot, nsq, nbar, ok = ops.kstats(U, p)
    if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.dtype.is_floating_point:
        raise Fail(f"kstats accepted an invalid U ({c.get('bad_U') or c['dtype']})")
    if c["coef"] in ("nan", "inf", "wrong_len", "2d"):
        raise Fail(f"kstats accepted an invalid p ({c['coef']})")
    pt = torch.as_tensor(p, dtype=torch.float64)
    want = reference.kstats(U, pt)
    if ok.dtype != torch.bool or not torch.equal(ok, want[3]):
        raise Fail(f"kstats: flags {ok.tolist()[:8]} != reference {want[3].tolist()[:8]}")
    A = U.to(torch.float64).abs()
    m = pt.abs() @ A
    e = 4 * (c["d"] + c["K"] + 2) * _eps(torch.float64)
    for name, got, ref, S in (
        ("kstats dot", dot, want[0], A @ m),
        ("kstats nsq", nsq, want[1], (A * A).sum(1)),
        ("kstats nbar", nbar, want[2], m @ m),
    ):
        if got.dtype != torch.float64:
            raise Fail(f"{name}: dtype {got.dtype}, expected float64")
        _check_close(name, got, ref, e * S + 1e-300, ~torch.isfinite(S) | (S > 1e300))
    return "ok"


def _select_args(g, c):
    """(U, rows, k, args, valid): the selection ops' arguments from the case (k = the selected rows)."""
    U = _matrix_input(g, c)
    rows = _rows_arg(g, c, c["K"])
    k = c["K"] if rows is None else (len(rows) if isinstance(rows, list) else rows.numel())
    b = c["bounds"]
    if c["target"].startswith("op:order_mean"):
        lo = {
            "median": (k - 1) // 2,
            "trim": int(c["beta"] * k),
            "min": 0,
            "max": k - 1,
            "all": 0,
            "random": int(torch.randint(0, max(k, 1), (1,), generator=g)),
            "lo_eq_hi": 1,
            "hi_gt_k": 0,
            "neg": -1,
            "float": 0.0,
            "bool": False,
        }[b]
        hi = {
            "median": k // 2 + 1,
            "trim": k - int(c["beta"] * k),
            "min": 1,
            "max": k,
            "all": k,
            "lo_eq_hi": 1,
            "hi_gt_k": k + 1,
            "neg": 1,
            "float": 1,
            "bool": 1,
        }.get(b)
        if b == "random":
            hi = lo + 1 + int(torch.randint(0, max(k - lo, 1), (1,), generator=g))
        args = (lo, hi)
        valid = type(lo) is int and type(hi) is int and 0 <= lo < hi <= k
    else:
        beta = {
            "one": 1,
            "half": max(1, k // 2),
            "all": k,
            "bulyan": max(1, k - 4 * (k // 4)),
            "zero": 0,
            "gt_k": k + 1,
            "float": 1.0,
        }[b]
        args = (beta,)
        valid = type(beta) is int and 1 <= beta <= k
    return U, rows, k, args, valid


def _run_select(g, c, name):
    """order_mean / closest_mean (+ _screened) vs the float64 reference: NaN exactly where the reference
    has it, the means within the rounding of the result plus a float64 sum of n values; the flags exactly."""
    U, rows, k, args, valid = _select_args(g, c)
    res = getattr(ops, name)(U, *args, rows=rows)
    if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.dtype.is_floating_point:
        raise Fail(f"{name} accepted an invalid U ({c.get('bad_U') or c['dtype']})")
    if c.get("rows") in ("bad_range", "neg", "float", "2d", "bool"):
        raise Fail(f"{name} accepted invalid rows ({c['rows']})")
    if not valid:
        raise Fail(f"{name} accepted invalid bounds {args} for k={k}")
    out, ok = res if name.endswith("_screened") else (res, None)
    base = name.replace("_screened", "")
    want = getattr(reference, base)(U, *args, rows=rows)
    idx = torch.arange(U.size(0)) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    X = U.index_select(0, idx).to(torch.float64)
    if ok is not None and (ok.dtype != torch.bool or not torch.equal(ok, reference.finite_rows(X))):
        raise Fail(f"{name}: flags {ok.tolist()[:8]} != reference {reference.finite_rows(X).tolist()[:8]}")
    want_dt = torch.float64 if U.dtype == torch.float64 else torch.float32
    if out.dtype != want_dt or out.shape != (U.size(1),):
        raise Fail(f"{name}: result {out.dtype} {tuple(out.shape)}, expected {want_dt} ({U.size(1)},)")
    n = args[1] - args[0] if base == "order_mean" else args[0]
    # A: the largest finite magnitude of the column (an Inf elsewhere in it may lie outside the mean's
    # window, and must not take the rounding of the window's sum out of the bound)
    Xf = torch.where(torch.isfinite(X), X, torch.zeros_like(X)).abs()
    A = Xf.amax(0) if X.numel() else torch.zeros(U.size(1), dtype=torch.float64)
    # where a sum of n values may leave float64's range, its order decides between Inf and NaN (Inf - Inf)
    may_overflow = torch.isinf(want) | (A * n > torch.finfo(torch.float64).max / 4)
    if bool(((out.isnan() != want.isnan()) & ~may_overflow).any()):
        raise Fail(f"{name}: NaN columns differ from the reference")
    fi = torch.finfo(want_dt)
    tol = (
        fi.eps / 2 * want.abs().nan_to_num(posinf=0.0, neginf=0.0) + 2 * n * _eps(torch.float64) * A + fi.tiny * fi.eps
    )  # + half a subnormal step of the result
    inf = float("inf")
    _check_close(
        name,
        out.nan_to_num(nan=0.0, posinf=inf, neginf=-inf),
        want.nan_to_num(nan=0.0, posinf=inf, neginf=-inf),
        tol,
        may_overflow,
    )
    return "ok"


for _n in ("order_mean", "order_mean_screened", "closest_mean", "closest_mean_screened"):
    globals()["_run_" + _n] = (lambda nm: lambda g, c: _run_select(g, c, nm))(_n)


def _run_gram_screened(g, c):
    """G is gram's; ok = the reference's row flags, except (fp64 only) a finite row whose squared
    norm overflows, which is flagged (the documented limit)."""
    U = _matrix_input(g, c)
    G, ok = ops.gram_screened(U)
    if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.dtype.is_floating_point:
        raise Fail("gram_screened accepted an invalid U")
    want = reference.finite_rows(U)
    if U.dtype == torch.float64:
        over = ~torch.isfinite((U.abs().amax(1) if U.size(1) else U.new_zeros(U.size(0))) ** 2 * max(U.size(1), 1))
        want = want & ~(over & ~ok.cpu())
    if ok.dtype != torch.bool or not torch.equal(ok.cpu(), want):
        raise Fail(f"gram_screened: flags {ok.tolist()[:8]} != reference {want.tolist()[:8]}")
    plain = ops.gram(U)
    if not torch.equal(G.isnan(), plain.isnan()) or not torch.equal(G.nan_to_num(), plain.nan_to_num()):
        raise Fail("gram_screened: G differs from gram's")
    return "ok"


def _min_norm_G(g, c) -> Tuple[Any, bool]:
    K, kind = c["K"], c["gkind"]
    psd = kind in ("psd", "psd_lowrank", "dups", "zero_rows", "psd_scaled", "identity", "zeros")
    if kind == "1d":
        return torch.ones(K), False
    if kind == "nonsquare":
        return torch.ones(K, K + 1), False
    if kind == "int":
        return torch.eye(K, dtype=torch.int64), False
    m = {"psd_lowrank": max(1, K // 3)}.get(kind, K + 3)
    V = torch.randn(K, m, generator=g, dtype=torch.float64)
    if kind == "dups" and K > 1:
        V[1:] = V[:1]
    if kind == "zero_rows" and K > 0:
        V[: max(1, K // 2)] = 0
    G = V @ V.T
    if kind == "identity":
        G = torch.eye(K, dtype=torch.float64)
    elif kind == "zeros":
        G = torch.zeros(K, K, dtype=torch.float64)
    elif kind == "indefinite":
        A = torch.randn(K, K, generator=g, dtype=torch.float64)
        G = A + A.T
    elif kind == "neg_diag":
        G = -G
    elif kind == "nonsym":
        G = G + 0.5 * torch.randn(K, K, generator=g, dtype=torch.float64)
    elif kind == "nan" and K:
        G[0, -1] = float("nan")
    elif kind == "inf" and K:
        G[-1, 0] = float("inf")
    if kind in ("psd_scaled",) or c["scale_exp"]:
        G = G * 10.0 ** c["scale_exp"]
    G = G.to(FLOATS[c["dtype"]])
    if c["transposed"]:
        G = G.t().contiguous().t()
    return G, psd


def _mn_q_gap(G64, lam):
    v = G64 @ lam
    q = float(lam @ v)
    return q, q - float(v.min())


def _run_min_norm(g, c):
    G, psd = _min_norm_G(g, c)
    K = c["K"]
    lam0 = None
    lk = c["lam0"]
    if lk == "ok":
        lam0 = torch.rand(K, generator=g, dtype=torch.float64) + 0.1
    elif lk == "wrong_len":
        lam0 = torch.ones(K + 1)
    elif lk == "neg":
        lam0 = -torch.ones(K)
    elif lk == "zero":
        lam0 = torch.zeros(K)
    elif lk == "nan":
        lam0 = torch.full((K,), float("nan"))
    kw = dict(
        max_iter=c["max_iter"],
        tol=c["tol"],
        method=c["method"],
        init=c["init"],
        tol_abs=c["tol_abs"],
        polish=c["polish"],
        lam0=lam0,
    )
    lam, iters, gap = ops.min_norm(G, **kw)
    # accepted: check the arguments were valid
    if c["gkind"] in ("1d", "nonsquare", "int", "nan", "inf") or K == 0:
        raise Fail(f"min_norm accepted G of kind {c['gkind']} (K={K})")
    if not isinstance(c["max_iter"], int) or isinstance(c["max_iter"], bool) or c["max_iter"] < 0:
        raise Fail(f"min_norm accepted max_iter={c['max_iter']!r}")
    G64 = G.to(torch.float64)
    if not bool(torch.isfinite(G64).all()):
        raise Fail("min_norm accepted a non-finite G (after the dtype cast)")
    G64 = 0.5 * (G64 + G64.T)
    if lam.dtype != torch.float64 or lam.shape != (K,):
        raise Fail(f"min_norm: lam {lam.dtype} {tuple(lam.shape)}")
    if not bool(torch.isfinite(lam).all()) or bool((lam < 0).any()) or abs(float(lam.sum()) - 1.0) > 1e-12 * (K + 1):
        raise Fail(f"min_norm: lam not on the simplex: {lam.tolist()[:8]} (sum {float(lam.sum())!r})")
    if not isinstance(iters, int) or not 0 <= iters <= max(c["max_iter"], 0):
        raise Fail(f"min_norm: iterations {iters!r} outside [0, max_iter={c['max_iter']}]")
    scale = float(G64.abs().max()) if K else 0.0
    slack = 64 * (K + 1) * _eps(torch.float64) * scale
    if not math.isfinite(scale * (K + 1) ** 2):  # the quadratic form itself overflows fp64
        if not math.isfinite(gap) and not math.isnan(gap):
            return "ok"
        slack = float("inf")
    q, gap_r = _mn_q_gap(G64, lam)
    if not (math.isfinite(gap) or math.isinf(slack)):
        raise Fail(f"min_norm: gap {gap!r} is not finite")
    if abs(gap - gap_r) > slack:
        raise Fail(f"min_norm: reported gap {gap!r} != recomputed q - min(G lam) = {gap_r!r}")
    method = c["method"]
    if psd and method != "code_compat" and iters < c["max_iter"] and math.isfinite(slack):
        if gap_r > c["tol"] * q + c["tol_abs"] * float(torch.diagonal(G64).abs().max()) + slack:
            raise Fail(f"min_norm: stopped at iteration {iters} < max_iter with gap {gap_r!r} above the stop rule")
    if psd and K <= 30 and math.isfinite(slack):
        rl, _, _ = reference.min_norm(G64, **kw)
        qr, gr = _mn_q_gap(G64, rl.to(torch.float64))
        # both are feasible; duality: q* >= q - 2 gap for each of them
        if q < qr - 2 * max(gr, 0) - slack or qr < q - 2 * max(gap_r, 0) - slack:
            raise Fail(f"min_norm: q={q!r} (gap {gap_r!r}) inconsistent with the reference q={qr!r} (gap {gr!r})")
    return "ok"


def _gc_inputs(g, c):
    ts, origs = [], []
    for spec in c["tensors"]:
        dt = DTYPES[spec["dtype"]]
        shape = spec["shape"]
        lay = spec["layout"]
        if lay == "dup_prev" and ts:
            ts.append(ts[-1])
            origs.append(None)
            continue
        x = _values(g, shape, dt, spec["values"])
        if lay == "channels_last" and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        elif lay == "transposed" and x.dim() >= 2:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)
        elif lay == "sliced" and x.dim() >= 1:
            big = torch.zeros([s * 2 for s in shape], dtype=dt) if shape else torch.zeros((), dtype=dt)
            sl = big[tuple(slice(0, None, 2) for _ in shape)]
            sl.copy_(x)
            x = sl
        elif lay == "expanded" and x.dim() >= 1 and shape[0] > 0:
            x = x[:1].expand(*shape)
        ts.append(x)
        origs.append(x.clone())
    bl = c["bad_list"]
    if bl == "tensor":
        return (ts[0] if ts else torch.zeros(2, 3)), origs
    if bl == "nontensor_item":
        return ts + [[1.0, 2.0]], origs
    return ts, origs


def _gc_tol(x64, ref, dt, twice=False):
    acc = _acc_dtype(dt)
    if x64.dim() >= 2:
        rowmax = x64.abs().reshape(x64.size(0), -1).amax(1) if x64.numel() else x64.new_zeros(x64.size(0))
        M = x64.numel() // max(x64.size(0), 1)
        scale = rowmax.reshape([-1] + [1] * (x64.dim() - 1)).expand_as(x64)
    else:
        M = x64.numel()
        scale = x64.abs().max().expand_as(x64) if x64.numel() else x64
    tol = 4 * (M + 2) * _eps(acc) * scale + 2 * _eps(dt) * ref.abs().nan_to_num(0, 0, 0) + 4 * torch.finfo(dt).tiny
    if twice:  # projected twice in place: the second pass re-centres the rounded output
        tol = tol + 4 * _eps(dt) * scale
    rowsum = scale * M
    may = (
        ~torch.isfinite(rowsum) | (rowsum * 1.001 >= torch.finfo(acc).max) | (ref.abs() * 1.001 >= torch.finfo(dt).max)
    )
    return tol, may


def _run_gc(g, c, inplace: bool):
    ts, origs = _gc_inputs(g, c)
    fn = ops.gc_project_ if inplace else ops.gc_project
    name = "gc_project_" if inplace else "gc_project"
    res = fn(ts, c["vector_policy"], c["min_fanin"])
    if c["bad_list"] in ("tensor", "nontensor_item"):
        raise Fail(f"{name} accepted a bad tensors argument ({c['bad_list']})")
    if (
        c["vector_policy"] not in ("skip", "center")
        or not isinstance(c["min_fanin"], int)
        or isinstance(c["min_fanin"], bool)
        or c["min_fanin"] < 1
    ):
        raise Fail(f"{name} accepted vector_policy={c['vector_policy']!r} min_fanin={c['min_fanin']!r}")
    if any(not t.dtype.is_floating_point for t in ts):
        raise Fail(f"{name} accepted an integer tensor")
    if len(res) != len(ts):
        raise Fail(f"{name}: returned {len(res)} tensors for {len(ts)}")
    # reference on the original values; a tensor listed twice is projected twice (GC is idempotent)
    base_vals = []
    for i, o in enumerate(origs):
        base_vals.append(base_vals[-1] if o is None else o)
    refs = reference.gc_project(base_vals, c["vector_policy"], c["min_fanin"])
    for i, (t_in, r_out, ref, x0) in enumerate(zip(ts, res, refs, base_vals)):
        if inplace and r_out is not t_in:
            raise Fail(f"{name}: result {i} is not the input tensor")
        if r_out.shape != x0.shape or r_out.dtype != x0.dtype:
            raise Fail(
                f"{name}: result {i} is {r_out.dtype} {tuple(r_out.shape)}, expected {x0.dtype} {tuple(x0.shape)}"
            )
        if c["tensors"][i]["layout"] == "dup_prev" and not inplace:
            continue  # out of place: the duplicate is projected once from the original values
        twice = inplace and any(t is t_in for j, t in enumerate(ts) if j != i)
        tol, may = _gc_tol(x0.to(torch.float64), ref, x0.dtype, twice)
        if twice and bool(may.any()):  # an overflow in the first pass feeds Inf into the second
            may = torch.ones_like(may)
        _check_close(f"{name}[{i}]", r_out, ref, tol, may)
    return "ok"


def _run_gc_project(g, c):
    return _run_gc(g, c, False)


def _run_gc_project_(g, c):
    return _run_gc(g, c, True)


def synthetic_spec(d: int, dtype=torch.float32) -> FlatSpec:
    """A FlatSpec of length d: modules l0 (weight [a, b] + bias [a]) and l1 (weight + bias) when d
    allows, else one vector; used for layer-aware methods and gc_project_flat_."""
    entries, off, i = [], 0, 0

    def add(name, module, shape, kind):
        nonlocal off, i
        n = math.prod(shape)
        entries.append(
            ParamEntry(
                name=name,
                module=module,
                shape=tuple(shape),
                offset=off,
                numel=n,
                kind=kind,
                index=i,
                layer_from_output=0,
            )
        )
        off += n
        i += 1

    if d >= 8:
        a1 = 2
        rest1 = d // 2
        b1 = max(1, (rest1 - a1) // a1)
        add("l0.weight", "l0", (a1, b1), "linear")
        add("l0.bias", "l0", (a1,), "vector")
        left = d - off
        a2 = 3 if left >= 6 else 1
        b2 = (left - a2) // a2
        if b2 >= 1:
            add("l1.weight", "l1", (a2, b2), "linear")
            add("l1.bias", "l1", (d - off,), "vector")
        else:
            add("l1.bias", "l1", (d - off,), "vector")
    elif d >= 2:
        add("l0.weight", "l0", (1, d - 1), "linear")
        add("l1.bias", "l1", (1,), "vector")
    elif d == 1:
        add("l0.bias", "l0", (1,), "vector")
    lfo = {}
    mods = []
    for e in entries:
        if e.module not in mods:
            mods.append(e.module)
    lfo = {m: len(mods) - 1 - k for k, m in enumerate(mods)}
    entries = [ParamEntry(**{**e.__dict__, "layer_from_output": lfo[e.module]}) for e in entries]
    assert off == d, (off, d)
    return FlatSpec(entries=entries, d=d, dtype=dtype)


def _run_gc_project_flat_(g, c):
    d, K = c["d"], c["K"]
    dt = DTYPES[c["dtype"]]
    spec = synthetic_spec(d, dt)
    shape = (d,) if K is None else (K, d)
    vec = _values(g, shape, dt, c["values"])
    bad = c["bad"]
    if bad == "wrong_d":
        vec = _values(g, shape[:-1] + (d + 1,), dt, "normal")
    elif bad == "strided":
        big = torch.zeros(shape[:-1] + (2 * d + 2,), dtype=dt)
        vec = big[..., ::2][..., :d] if d > 1 else big[..., ::2]
    elif bad == "3d":
        vec = vec.reshape((1, 1) + shape)
    x0 = vec.clone()
    sel = (lambda e: e.kind != "vector") if c["select"] == "no_bias" else None
    res = ops.gc_project_flat_(vec, spec, c["vector_policy"], c["min_fanin"], select=sel)
    if bad is not None and not (bad == "strided" and d <= 1):
        raise Fail(f"gc_project_flat_ accepted a bad vec ({bad})")
    if res is not vec:
        raise Fail("gc_project_flat_ did not return vec")
    rows = [x0] if x0.dim() == 1 else list(x0.unbind(0))
    outs = [vec] if vec.dim() == 1 else list(vec.unbind(0))
    for k, (r0, o) in enumerate(zip(rows, outs)):
        ref = r0.to(torch.float64).clone()
        for e in spec.entries:
            if sel is not None and not sel(e):
                continue
            piece = r0[e.slice].view(e.shape)
            ref[e.slice] = reference.gc_project([piece], c["vector_policy"], c["min_fanin"])[0].reshape(-1)
        for e in spec.entries:
            piece0 = r0[e.slice].view(e.shape).to(torch.float64)
            tol, may = _gc_tol(piece0, ref[e.slice].view(e.shape), dt)
            _check_close(
                f"gc_project_flat_[{k}].{e.name}", o[e.slice].view(e.shape), ref[e.slice].view(e.shape), tol, may
            )
    return "ok"


def _lu_matrix(g, c):
    n, kind = c["n"], c["akind"]
    dt = FLOATS[c["dtype"]]
    A = torch.randn(n, n, generator=g, dtype=torch.float64)
    if kind == "diag_dom":
        A = A + n * torch.eye(n, dtype=torch.float64)
    elif kind == "singular" and n:
        A[-1] = A[0] if n > 1 else 0
    elif kind == "zero":
        A = torch.zeros(n, n, dtype=torch.float64)
    elif kind == "nan" and n:
        A[0, 0] = float("nan")
    elif kind == "nonsquare":
        A = torch.randn(n, n + 1, generator=g, dtype=torch.float64)
    elif kind == "near_singular" and n > 1:
        A[-1] = A[0] + 1e-14 * A[-1]
    elif kind == "huge":
        A = A * 1e300
    elif kind == "denormal":
        A = A * 1e-310
    A = A.to(dt) if kind != "int" else A.round().to(torch.int64)
    if c["transposed"] and A.dim() == 2:
        A = A.t().contiguous().t()
    return A


def _lu_check_solution(name, A, X, B):
    """Backward-error check: ||A X - B|| <= c n eps (||A|| ||X|| + ||B||), columnwise, in fp64."""
    A64, X64, B64 = A.to(torch.float64), X.to(torch.float64), B.to(torch.float64)
    n = A64.size(0)
    if X.shape != B.shape:
        raise Fail(f"{name}: solution shape {tuple(X.shape)} != rhs shape {tuple(B.shape)}")
    if not bool(torch.isfinite(X64).all()):
        return "nonfinite"
    eps = _eps(A.dtype if A.dtype.is_floating_point else torch.float64)
    R = A64 @ X64 - B64
    Xc = X64 if X64.dim() == 2 else X64[:, None]
    Rc = R if R.dim() == 2 else R[:, None]
    Bc = B64 if B64.dim() == 2 else B64[:, None]
    an = float(A64.abs().sum(0).max()) if n else 0.0
    lhs = Rc.abs().sum(0)
    rhs = 8 * (n + 1) ** 2 * eps * (an * Xc.abs().sum(0) + Bc.abs().sum(0)) + 1e-300
    if bool((lhs > rhs).any()):
        raise Fail(f"{name}: backward error {float((lhs / rhs).max()):.3g} x the bound")
    return "ok"


def _run_lu_factor(g, c):
    return _run_lu(g, c, solve=False)


def _run_lu_solve(g, c):
    return _run_lu(g, c, solve=True)


def _run_lu(g, c, solve: bool):
    A = _lu_matrix(g, c)
    res = ops.lu_factor(A)
    if c["akind"] in ("nan", "nonsquare", "int"):
        raise Fail(f"lu_factor accepted A of kind {c['akind']}")
    LU, piv = res[0], res[1]
    n = c["n"]
    if tuple(LU.shape) != (n, n):
        raise Fail(f"lu_factor: LU shape {tuple(LU.shape)}")
    if not solve:
        # P A = L U reconstruction (fp64 check)
        P, L, Uu = torch.lu_unpack(LU.to(torch.float64), piv.to(torch.int32) if piv.dtype != torch.int32 else piv)
        if not bool(torch.isfinite(LU.to(torch.float64)).all()):
            return "ok"  # singular / overflowing input: non-finite factors are the IEEE answer
        R = P @ L @ Uu - A.to(torch.float64)
        bound = 8 * (n + 1) ** 2 * _eps(A.dtype) * (L.abs() @ Uu.abs()).max().clamp_min(1e-300)
        if n and float(R.abs().max()) > float(bound):
            raise Fail(f"lu_factor: ||P L U - A|| = {float(R.abs().max()):.3e} > {float(bound):.3e}")
        return "ok"
    nrhs = c["nrhs"]
    B = torch.randn((n,) if nrhs is None else (n, nrhs), generator=g, dtype=torch.float64).to(A.dtype)
    X = ops.lu_solve(LU, piv, B)
    if c["akind"] in ("singular", "zero", "near_singular"):
        return "ok"  # no solution to check against; no crash and no hang is the requirement
    _lu_check_solution("lu_solve", A, X, B)
    return "ok"


def _run_lu_factor_ex(g, c):
    A = _lu_matrix(g, c)
    LU, piv, info = ops.lu_factor_ex(A)
    if c["akind"] in ("nonsquare", "int"):
        raise Fail(f"lu_factor_ex accepted A of kind {c['akind']}")
    n = c["n"]
    if tuple(LU.shape) != (n, n) or LU.dtype != A.dtype or piv.dtype != torch.int32:
        raise Fail(f"lu_factor_ex: LU {LU.dtype} {tuple(LU.shape)}, pivots {piv.dtype}")
    if not bool(torch.isfinite(A.to(torch.float64)).all()) or int(info) != 0:
        return "ok"  # NaN input or an exactly-zero pivot (reported in info): nothing to reconstruct
    P, L, Uu = torch.lu_unpack(LU.to(torch.float64), piv)
    if not bool(torch.isfinite(LU.to(torch.float64)).all()):
        if float(A.to(torch.float64).abs().max()) < 1e300:
            raise Fail("lu_factor_ex: non-finite factors of a finite, moderate A with info = 0")
        return "ok"
    R = P @ L @ Uu - A.to(torch.float64)
    bound = 8 * (n + 1) ** 2 * _eps(A.dtype) * (L.abs() @ Uu.abs()).max().clamp_min(1e-300)
    if n and float(R.abs().max()) > float(bound):
        raise Fail(f"lu_factor_ex: ||P L U - A|| = {float(R.abs().max()):.3e} > {float(bound):.3e}")
    return "ok"


def _run_fedecado_be_step(g, c):
    K, d = c["K"], c["d"]
    dt_ = DTYPES[c["dtype"]]
    f = lambda *sh: torch.randn(*sh, generator=g, dtype=torch.float64)  # noqa: E731
    cast = lambda t: t.to(dt_) if dt_.is_floating_point else t.round().to(dt_)  # noqa: E731
    kind = c["kind"]
    U = f(K, d) * 0.1
    if kind == "nan" and K and d:
        U[0, 0] = float("nan")
    if kind == "huge":
        U = U * 1e300
    xc, xc0 = f(d), f(d)
    Icur, Ik = f(K, d) * 0.01, f(K, d) * 0.01
    S_off = None if kind == "no_soff" else f(d) * 0.01
    thn = (0.2 + torch.rand(K, generator=g, dtype=torch.float64)).tolist()
    tho = [t * 0.5 for t in thn]
    ig = torch.rand(K, generator=g, dtype=torch.float64).tolist()
    if kind == "neg_inv_g" and K:
        ig[0] = -1.0
    if kind == "wrong_theta_len":
        thn = thn + [0.5]
    dt, L = (0.0 if kind == "bad_dt" else 0.05), 3.0
    Uc = _layout(g, cast(U), c["layout"])
    Icur_c, Ik_c = cast(Icur), cast(Ik)
    if kind == "wrong_shape":
        Ik_c = cast(f(K, d + 1))
    args = (cast(xc), Icur_c, cast(xc0), Uc, Ik_c, None if S_off is None else cast(S_off), thn, tho, ig, dt, L)
    out = None
    if c["use_out"] and dt_.is_floating_point:
        out = (torch.empty(d, dtype=dt_), torch.empty(K, d, dtype=dt_))
    if c.get("window"):  # the window's first step is the single call; a second step from its result
        win = ops.BEStepWindow(args[2], args[3], args[4], args[5], L, xc=args[0], Icur=args[1], out=out)
        xn, In, lte = win.step(thn, tho, ig, dt, src=None, dst=0)
        lte = lte.clone()
        x2, I2, l2 = win.step(thn, tho, ig, dt, src=0, dst=1)
        w2 = ops.fedecado_be_step(xn.clone(), In.clone(), *args[2:])
        if not all(
            torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
            for a, b in zip((x2, I2, l2), w2)
        ):
            raise Fail("BEStepWindow: a second step differs from fedecado_be_step on the same state")
    else:
        xn, In, lte = ops.fedecado_be_step(*args, out=out)
    invalid = kind in ("bad_dt", "wrong_shape", "wrong_theta_len") or (kind == "neg_inv_g" and K > 0)
    if dt_ not in (torch.float32, torch.float64) or invalid:
        raise Fail(f"fedecado_be_step accepted dtype {dt_} / case {kind}")
    if xn.shape != (d,) or In.shape != (K, d) or xn.dtype != dt_ or In.dtype != dt_ or lte.shape != (2,):
        raise Fail(f"fedecado_be_step: shapes/dtypes {tuple(xn.shape)} {tuple(In.shape)} {xn.dtype} {lte.shape}")
    if out is not None and (xn.data_ptr() != out[0].data_ptr() or In.data_ptr() != out[1].data_ptr()):
        raise Fail("fedecado_be_step: results not written into out")
    r = [t.to(torch.float64) if isinstance(t, torch.Tensor) else t for t in args]
    rx, rI, rl = reference.fedecado_be_step(*r)
    if kind == "nan" and K and d:
        if not bool(torch.isinf(lte).any()):
            raise Fail("fedecado_be_step: NaN input did not force a rejection (LTE must be +inf)")
        return "ok"
    if not bool(torch.isfinite(rx).all() and torch.isfinite(rI).all()):
        return "ok"  # overflowing input: no finite reference to compare with
    check_fedecado_be_step(r, (xn, In, lte), (rx, rI, rl), dt_)
    return "ok"


def be_step_bounds(args, dtype):
    """Error bounds for fedecado_be_step's (x', I', lte) against the float64 reference, from the
    maths in the op's header (csrc/cpu/fedecado_be_step.cpp), per coordinate j:

        r_i = Icur_i + c (xc0 + thn_i U_i + ig_i Ik_i),  x' = (xc + dt S + dt sum_i r_i / a_i) / den,
        I'_i = (r_i - c x') / a_i,   c = dt/L > 0, a_i = 1 + c ig_i >= 1, den >= 1.

    The op evaluates this in float64 (K + O(1) roundings per output, coefficients included); the
    reference solves the same (K+1) x (K+1) system by LU. A sum of n rounded terms is off by at most
    gamma_n = n u / (1 - n u) times the sum of the terms' absolute values (Higham, Accuracy and
    Stability, §3.1), so the error scale is the same formulas on absolute values,
        rho_i = |Icur_i| + c (|xc0| + |thn_i| |U_i| + ig_i |Ik_i|),
        X = (|xc| + dt |S| + dt sum_i rho_i / a_i) / den >= |x'|,   Y_i = (rho_i + c X) / a_i >= |I'_i|,
    not |x'| or |I'_i|: the terms cancel (huge U of mixed signs gives an x' 1e4 below its terms,
    where a bound relative to |x'| fails on two correctly rounded answers). Both sides' errors plus
    the one rounding to the output dtype stay below 64 (K + 2) eps(dtype) X (resp. Y_i), the
    constant this check always used. The LTEs are maxima of |.| of sums formed from the stored x',
    I' (|max a - max b| <= max |a - b|): their bounds are the propagated x'/I' bounds plus the
    float64 rounding of those sums on both sides. Returns (tol_x [d], tol_I [K, d], tol_lte [2])."""
    xc, Icur, xc0, U, Ik, S, thn, tho, ig, dt, L = args
    f64 = lambda t: torch.as_tensor(t, dtype=torch.float64)  # noqa: E731
    thn, tho, ig = f64(thn), f64(tho), f64(ig)
    K, d = U.shape
    S = torch.zeros(d, dtype=torch.float64) if S is None else S
    e64, tiny = _eps(torch.float64), torch.finfo(dtype).tiny
    c = dt / L
    a = 1.0 + c * ig
    den = 1.0 + dt * c * float((1.0 / a).sum())
    rho = Icur.abs() + c * (xc0.abs()[None] + thn.abs()[:, None] * U.abs() + ig[:, None] * Ik.abs())
    X = (xc.abs() + dt * S.abs() + dt * (rho / a[:, None]).sum(0)) / den
    Y = (rho + c * X[None]) / a[:, None]
    g = 64 * (K + 2) * _eps(dtype)
    tol_x, tol_I = g * X + tiny, g * Y + tiny
    if K == 0 or d == 0:
        return tol_x, tol_I, torch.zeros(2, dtype=torch.float64)
    Ia = Y + Icur.abs()
    lc = 0.5 * dt * float((tol_I.sum(0) + 2 * (K + 1) * e64 * Ia.sum(0)).max())
    dth = (thn - tho).abs()
    eI = (
        ig[:, None] * tol_I + tol_x[None] + 8 * e64 * (dth[:, None] * U.abs() + ig[:, None] * Ia + (X + xc.abs())[None])
    )
    lI = 0.5 * dt / L * float(eI.max())
    return tol_x, tol_I, torch.tensor([lc, lI], dtype=torch.float64)


def check_fedecado_be_step(args, got, ref, dtype) -> None:
    """Raise Fail where fedecado_be_step's outputs ``got`` = (x', I', lte) differ from the float64
    reference ``ref`` by more than :func:`be_step_bounds` (args: the op's arguments in float64)."""
    tol_x, tol_I, tol_l = be_step_bounds(args, dtype)
    for name, o, r, tol in (("x_c'", got[0], ref[0], tol_x), ("I'", got[1], ref[1], tol_I)):
        err = (o.to(torch.float64) - r).abs()
        bad = err > tol
        if bool(bad.any()):
            i = int(torch.nonzero(bad.reshape(-1))[0])
            raise Fail(
                f"fedecado_be_step: {name} off by {err.reshape(-1)[i].item():.3e} > bound "
                f"{tol.reshape(-1)[i].item():.3e} (got {o.reshape(-1)[i].item()!r}, ref "
                f"{r.reshape(-1)[i].item()!r}, flat index {i})"
            )
    lte, rl = got[2], ref[2]
    if bool(torch.isfinite(rl).all()) and bool(((lte - rl).abs() > tol_l).any()):
        raise Fail(f"fedecado_be_step: lte {lte.tolist()} vs reference {rl.tolist()} (bound {tol_l.tolist()})")


def _run_arrowhead_solve(g, c):
    K, m = c["K"], c["m"]
    dt = DTYPES[c["dtype"]]
    f = lambda *sh: torch.randn(*sh, generator=g, dtype=torch.float64)  # noqa: E731
    if c["akind"] in ("fedecado", "huge"):
        dtv = 0.1
        a = 1.0 + torch.rand(K, generator=g, dtype=torch.float64)
        b, cc, alpha = -dtv, dtv / 2.0, 1.0
    else:
        a, b, cc, alpha = f(K), f(K), f(K), float(f(1))
    if c["akind"] == "zero_a" and K:
        a[0] = 0.0
    if c["akind"] == "nan" and K:
        a[0] = float("nan")
    if c["akind"] == "wrong_len":
        a = f(K + 1)
    R = f(K, m)
    if c["akind"] == "huge":
        R = R * 1e300
    R = _layout(g, R.to(dt) if dt.is_floating_point else R.round().to(dt), c["layout"])
    r0 = f(m).to(R.dtype)
    x, I = ops.arrowhead_solve(a, b, cc, alpha, r0, R)
    if dt not in (torch.float32, torch.float64) or c["akind"] == "wrong_len" or (c["akind"] == "nan" and K):
        raise Fail(f"arrowhead_solve accepted dtype {dt} / a of kind {c['akind']}")
    if x.shape != (m,) or I.shape != (K, m) or x.dtype != dt or I.dtype != dt:
        raise Fail(f"arrowhead_solve: x {x.dtype} {tuple(x.shape)}, I {I.dtype} {tuple(I.shape)}")
    a64 = torch.as_tensor(a, dtype=torch.float64)
    b64 = torch.as_tensor(b, dtype=torch.float64).expand(K)
    c64 = torch.as_tensor(cc, dtype=torch.float64).expand(K)
    M = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    M[0, 0] = alpha
    M[0, 1:] = b64
    M[1:, 0] = c64
    M[1:, 1:] = torch.diag(a64)
    Z = torch.cat([x.to(torch.float64)[None], I.to(torch.float64)])
    B = torch.cat([r0.to(torch.float64)[None], R.to(torch.float64)])
    if not bool(torch.isfinite(Z).all()):
        if c["akind"] in ("fedecado",) and bool(torch.isfinite(B).all()):
            raise Fail("arrowhead_solve: non-finite solution of the (well-conditioned) FedECADO system")
        return "ok"  # singular (a_i = 0 or a zero Schur complement) or overflowing input
    if c["akind"] in ("fedecado",):
        res = (M @ Z - B).abs()
        scale = M.abs() @ Z.abs() + B.abs()
        if bool((res > 16 * (K + 2) * _eps(dt) * scale + 1e-300).any()):
            raise Fail(f"arrowhead_solve: residual {float((res / scale.clamp_min(1e-300)).max()):.3e} x |M||Z|+|B|")
    return "ok"


def _sgd_inputs(g, c):
    ps, gs, bs, ca, cs = [], [], [], [], []
    for spec in c["params"]:
        dt = DTYPES[spec["dtype"]]

        def mk(kind):
            x = _values(g, spec["shape"], dt, kind)
            if spec["layout"] == "transposed" and x.dim() >= 2:
                x = x.transpose(0, 1).contiguous().transpose(0, 1)
            elif spec["layout"] == "sliced" and x.dim() >= 1:
                big = torch.zeros([2 * s for s in spec["shape"]], dtype=dt)
                v = big[tuple(slice(0, None, 2) for _ in spec["shape"])]
                v.copy_(x)
                x = v
            return x

        ps.append(mk("normal"))
        gs.append(mk(c["values"]))
        bs.append(mk("normal"))
        ca.append(mk("normal"))
        cs.append(mk("normal"))
    return ps, gs, bs, ca, cs


def _run_sgd(g, c, which: str):
    ps, gs, bs, ca, cs = _sgd_inputs(g, c)
    n = len(ps)
    kw = dict(lr=c["lr"], momentum=c["momentum"], weight_decay=c["weight_decay"], first_step=c["first_step"])
    corr, gcm = c["corr"], c["gc"]
    c_add = c_sub = None
    if corr in ("add", "both", "c_only", "c_ci", "subset"):
        c_add = ca
    if corr in ("sub", "both", "c_ci"):
        c_sub = cs
    if corr == "some_none" and n:
        c_add = [None] + ca[1:]
    if corr == "wrong_shape" and n:
        c_add = [torch.zeros(7, dtype=ps[0].dtype)] + ca[1:]
    gc_mask = gcm
    if gcm == "per":
        gc_mask = [bool(i % 2) for i in range(n)]
    elif gcm == "bad_len":
        gc_mask = [True] * (n + 1)
    bufs = bs if c["momentum"] != 0 else None
    bad = c["bad"]
    if bad == "grads_len":
        gs = gs + [torch.zeros(1)]
    elif bad == "grad_dtype" and not n:
        bad = None
    elif bad == "grad_dtype" and n:
        gs = [gs[0].to(torch.float64 if gs[0].dtype != torch.float64 else torch.float32)] + gs[1:]
    elif bad == "no_bufs":
        bufs = None
    plist = ps[0] if bad == "tensor" and n else ps
    # the float64 reference on copies (same semantics, fedkernels.reference)
    rp = [p.clone() for p in ps]
    rb = None if bufs is None else [b.clone() for b in bufs]
    p0 = [p.clone() for p in ps]
    if which == "fused_sgd_step_":
        ops.fused_sgd_step_(
            plist,
            gs,
            bufs,
            c_add=c_add,
            c_sub=c_sub,
            gc_mask=gc_mask,
            vector_policy=c["vector_policy"],
            min_fanin=c["min_fanin"],
            **kw,
        )
        ref_kw = dict(
            c_add=c_add, c_sub=c_sub, gc_mask=gc_mask, vector_policy=c["vector_policy"], min_fanin=c["min_fanin"]
        )
    elif which == "corrected_sgd_step_":
        subset = [i % 2 == 0 for i in range(n)] if corr == "subset" else None
        ops.corrected_sgd_step_(plist, gs, ca, cs if corr == "c_ci" else None, bufs, subset=subset, **kw)
        keep = subset if subset is not None else [True] * n
        ref_kw = dict(
            c_add=[ca[i] if keep[i] else None for i in range(n)],
            c_sub=[cs[i] if keep[i] else None for i in range(n)] if corr == "c_ci" else None,
        )
    else:
        ops.gc_sgd_step_(
            plist, gs, bufs, gc_mask=gc_mask, vector_policy=c["vector_policy"], min_fanin=c["min_fanin"], **kw
        )
        ref_kw = dict(gc_mask=gc_mask, vector_policy=c["vector_policy"], min_fanin=c["min_fanin"])
    if (
        bad is not None
        or corr == "wrong_shape"
        or gcm == "bad_len"
        or isinstance(c["lr"], str)
        or not math.isfinite(float(c["lr"]))
        or c["momentum"] < 0
        or any(not p.dtype.is_floating_point for p in ps)
    ):
        if (
            not (bad == "no_bufs" and c["momentum"] == 0)
            and not (n == 0 and bad in ("tensor",))
            and not (n == 0 and corr == "wrong_shape")
            and not (n == 0 and gcm == "bad_len" and False)
        ):
            raise Fail(
                f"{which} accepted invalid input (bad={bad}, corr={corr}, gc={gcm}, lr={c['lr']!r}, "
                f"momentum={c['momentum']})"
            )
        return "ok"
    ref_ps = [p.to(torch.float64) for p in p0]
    ref_out = [p.clone() for p in ref_ps]
    ref_bufs = None if rb is None else [b.to(torch.float64) for b in rb]
    reference.fused_sgd_step_(
        ref_out,
        [x.to(torch.float64) for x in gs],
        ref_bufs,
        **{
            k: (
                [None if v is None else v.to(torch.float64) for v in val]
                if isinstance(val, list) and k in ("c_add", "c_sub")
                else val
            )
            for k, val in ref_kw.items()
        },
        **kw,
    )
    for i, (p, r, x0) in enumerate(zip(ps, ref_out, p0)):
        dt = p.dtype
        acc = _acc_dtype(dt)
        gm = gs[i].to(torch.float64).abs()
        M = max(1, gm.numel() // max(gm.size(0), 1)) if gm.dim() else 1
        rowmax = gm.max() if gm.numel() else torch.tensor(0.0, dtype=torch.float64)
        scale = x0.to(torch.float64).abs() + abs(float(c["lr"])) * (
            4 * (M + 2) * rowmax
            + 3
            + abs(c["weight_decay"]) * x0.to(torch.float64).abs()
            + (bs[i].to(torch.float64).abs() if bufs else 0)
        )
        tol = 16 * _eps(acc) * scale + 2 * _eps(dt) * r.abs().nan_to_num(0, 0, 0) + 4 * torch.finfo(dt).tiny
        may = ~torch.isfinite(scale) | (scale * 4 >= torch.finfo(acc).max) | (r.abs() * 1.01 >= torch.finfo(dt).max)
        _check_close(f"{which}: params[{i}]", p, r, tol, may)
    return "ok"


def _run_fused_sgd_step_(g, c):
    return _run_sgd(g, c, "fused_sgd_step_")


def _run_corrected_sgd_step_(g, c):
    return _run_sgd(g, c, "corrected_sgd_step_")


def _run_gc_sgd_step_(g, c):
    return _run_sgd(g, c, "gc_sgd_step_")


def server_opt_expected(x, g, m, v, rule, lr, beta_1, beta_2, tau, sdt, dt, from_model=False):
    """float64 recomputation of ops.server_opt_step_ and the bound on |got - want| that its arithmetic
    allows: (want, m', v', tol of the new model, tol of m', tol of v', may). The pseudo-gradient (io, or
    io - x) and Yogi's sign of v - g^2 are formed as the kernel forms them, in the state's precision
    (at a tie the sign depends on the precision, not on the kernel). Bounds, with e = eps of the state:
    m' = fma(b1, m, c1 g): 2e (|b1 m| + |c1 g|) (the rounded coefficients, the product, the fma);
    v': 3e (|b2 v| + c2 g^2) (adam), 3e (|v| + c2 g^2) (yogi), e (v + g^2) (adagrad); sqrt(v') moves by
    min(dv / (2 sqrt v'), sqrt(dv)) + e sqrt(v'), the + tau by e of the sum; the step lr m' / den then
    moves by |lr| (dm + |step / lr| dden) / den_lo + 3e |step|; the add to x and the rounding to the
    model's dtype by e |new| + eps(dt) |new|. ``may``: where an intermediate leaves the state's range (or
    tau = 0 meets a v' near the subnormals): nothing is asserted there but NaN/Inf propagation."""
    f64 = torch.float64
    gA = (g.to(sdt) - x.to(sdt)) if from_model else g.to(sdt)
    g2A = gA * gA  # rounded in the state's precision
    g64, x64, m64, v64 = gA.to(f64), x.to(f64), m.to(f64), v.to(f64)
    b1, b2, e, fi = beta_1, beta_2, _eps(sdt), torch.finfo(sdt)
    sub = fi.tiny * e
    m1 = b1 * m64 + (1 - b1) * g64
    gg = g64 * g64
    if rule == "adam":
        v1 = b2 * v64 + (1 - b2) * gg
        dv = 3 * e * (b2 * v64.abs() + (1 - b2) * gg)
    elif rule == "yogi":
        s = torch.sign(v.to(sdt) - g2A).to(f64).nan_to_num(0.0)
        v1 = v64 - (1 - b2) * gg * s
        v1 = torch.where(
            torch.isnan(g2A) | torch.isnan(v) | (torch.isinf(g2A) & torch.isinf(v)),
            torch.full_like(v1, float("nan")),
            v1,
        )
        dv = 3 * e * (v64.abs() + (1 - b2) * gg)
    else:
        v1 = v64 + gg
        dv = e * (v64.abs() + gg)
    dv = dv + 4 * sub
    dm = 2 * e * (b1 * m64.abs() + (1 - b1) * g64.abs()) + 4 * sub
    rv = torch.sqrt(v1)
    dden = torch.minimum(dv / (2 * rv), torch.sqrt(dv)) + e * (rv + tau)
    den = rv + tau
    step = lr * m1 / den
    want = x64 + step
    den_lo = (den - dden).clamp_min(0)
    with torch.no_grad():
        tol = (
            abs(lr) * (dm + (m1 / den).abs() * dden) / den_lo
            + 3 * e * step.abs()
            + e * want.abs()
            + _eps(dt) * want.abs()
            + torch.finfo(dt).tiny
        )
    big = fi.max / 4
    may = (
        (gg >= big)
        | (m1.abs() >= big)
        | (v1 >= big)
        | (want.abs() * 1.01 >= torch.finfo(dt).max)
        | (den_lo == 0)
        | ((v1 < 2**30 * fi.tiny) & (tau == 0))
    )
    inf = float("inf")
    return (
        want,
        m1,
        v1,
        torch.where(may, torch.full_like(tol, inf), tol).nan_to_num(inf),
        torch.where(may, torch.full_like(dm, inf), dm),
        torch.where(may, torch.full_like(dv, inf), dv),
        may,
    )


def _run_server_opt_step_(g, c):
    """The fused server-optimiser step against server_opt_expected (float64, with its derived bound)."""
    dt, d = DTYPES[c["dtype"]], c["d"]
    sdt = FLOATS[c["state"]]
    x = _values(g, [d], dt, "normal")
    io = _values(g, [d], dt, c["values"])
    if c["from_model"] and dt.is_floating_point:
        io = (x.to(torch.float64) + io.to(torch.float64)).to(dt)
    m = _values(g, [d], sdt, "normal") * 0.1
    v = _values(g, [d], sdt, "normal").abs() * 0.01
    if c["values"] in ("nan", "inf") and d:
        v[0] = float("inf") if c["values"] == "inf" else v[0]
    if c["layout"] == "strided":

        def strided(t):
            big = torch.zeros(2 * d, dtype=t.dtype)
            big[::2] = t
            return big[::2]

        x, io, m, v = strided(x), strided(io), strided(m), strided(v)
    io0, m0, v0 = io.clone(), m.clone(), v.clone()
    bad = c["bad"]
    args = dict(
        rule=c["rule"], lr=c["lr"], beta_1=c["beta_1"], beta_2=c["beta_2"], tau=c["tau"], from_model=c["from_model"]
    )
    xa = x
    if bad == "len":
        xa = torch.zeros(d + 1, dtype=dt)
    elif bad == "io_dtype":
        io = io.to(torch.float64 if dt != torch.float64 else torch.float32)
    ops.server_opt_step_(io, m, x if bad == "alias" else v, xa, **args)
    invalid = (
        (bad is not None and not (bad == "alias" and d == 0))
        or c["rule"] not in ops.SERVER_OPT_RULES
        or not math.isfinite(c["lr"])
        or c["tau"] < 0
        or not 0 <= c["beta_1"] <= 1
        or not 0 <= c["beta_2"] <= 1
        or not dt.is_floating_point
        or sdt not in (torch.float32, torch.float64)
        or (dt == torch.float64 and sdt != torch.float64)
    )
    if invalid:
        raise Fail(
            f"server_opt_step_ accepted invalid input (bad={bad}, rule={c['rule']}, dtype={c['dtype']}, "
            f"state={c['state']}, lr={c['lr']}, tau={c['tau']}, betas={c['beta_1']}, {c['beta_2']})"
        )
    want, m1, v1, tol, tol_m, tol_v, may = server_opt_expected(
        x, io0, m0, v0, c["rule"], c["lr"], c["beta_1"], c["beta_2"], c["tau"], sdt, dt, c["from_model"]
    )
    _check_close("server_opt_step_: io", io, want, tol, may)
    _check_close("server_opt_step_: m", m, m1, tol_m, may)
    _check_close("server_opt_step_: v", v, v1, tol_v, may)
    return "ok"


def _run_dvec(g, c, name):
    dt = torch.bool if c["dtype"] == "bool" else DTYPES[c["dtype"]]
    src = _values(g, c["shape"], torch.float64 if dt == torch.bool else dt, c["values"])
    x = (src > 0) if dt == torch.bool else src
    if c["nontensor"]:
        x = x.tolist()
    fn = getattr(ops, name)
    if name == "dot":
        y = _values(
            g,
            [c["shape"][-1] + 1] if c["mismatch"] else c["shape"],
            x.dtype if isinstance(x, torch.Tensor) else torch.float32,
            "normal",
        )
        got = fn(x, y)
        if c["mismatch"] or c["nontensor"]:
            raise Fail("dot accepted mismatched/non-tensor inputs")
        ref = float((x.to(torch.float64).reshape(-1) * y.to(torch.float64).reshape(-1)).sum())
        sc = float((x.to(torch.float64).abs().reshape(-1) * y.to(torch.float64).abs().reshape(-1)).sum())
    else:
        got = fn(x)
        if c["nontensor"]:
            raise Fail(f"{name} accepted a non-tensor")
        x64 = x.to(torch.float64)
        if name == "sqnorm":
            ref, sc = float((x64 * x64).sum()), float((x64 * x64).sum())
        elif name == "all_":
            if bool(got) != bool(x.all()):
                raise Fail(f"all_: {got} != {bool(x.all())}")
            return "ok"
        elif name == "any_":
            if bool(got) != bool(x.any()):
                raise Fail(f"any_: {got} != {bool(x.any())}")
            return "ok"
        elif name == "any_flag":
            if got.shape != (1,) or got.dtype != torch.bool or got.device != x.device or bool(got) != bool(x.any()):
                raise Fail(f"any_flag: {got} != [{bool(x.any())}]")
            return "ok"
        elif name == "amax_d":
            ref = x64.amax(dim=-1) if x64.size(-1) else x64.new_full(x64.shape[:-1], float("-inf"))
            _check_close("amax_d", got, ref, torch.zeros_like(ref), torch.zeros_like(ref, dtype=torch.bool))
            return "ok"
        else:
            ref = x64.mean(dim=-1)
            sc = x64.abs().mean(dim=-1) if x64.size(-1) else ref
            tol = (x64.size(-1) + 2) * 4 * _eps(
                _acc_dtype(x.dtype) if x.dtype.is_floating_point else torch.float64
            ) * sc.nan_to_num(0, 0, 0) + 2 * _eps(
                x.dtype if x.dtype.is_floating_point else torch.float64
            ) * ref.abs().nan_to_num(0, 0, 0)
            if x.dtype.is_floating_point:  # rounding the result to x's dtype: half its smallest subnormal step
                tol = tol + torch.finfo(x.dtype).smallest_normal * torch.finfo(x.dtype).eps
            may = ~torch.isfinite(sc) | (
                sc * x64.size(-1) * 1.01 >= torch.finfo(x.dtype if x.dtype.is_floating_point else torch.float64).max
            )
            _check_close("mean_d", got, ref, tol, may)
            return "ok"
    if not isinstance(got, float):
        raise Fail(f"{name}: returned {type(got).__name__}, expected float")
    t64 = torch.tensor([got], dtype=torch.float64)
    r64 = torch.tensor([ref], dtype=torch.float64)
    n = max(1, (x.numel() if isinstance(x, torch.Tensor) else 1))
    _check_close(
        name,
        t64,
        r64,
        torch.tensor([4 * (n + 2) * _eps(torch.float64) * sc + 1e-300], dtype=torch.float64),
        torch.tensor([not math.isfinite(sc) or sc > 1e300]),
    )
    return "ok"


for _n in ("dot", "sqnorm", "all_", "any_", "any_flag", "amax_d", "mean_d"):
    globals()["_run_" + _n] = (lambda nm: lambda g, c: _run_dvec(g, c, nm))(_n)


# ---------------------------------------------------------------------------------------------
# aggregators
# ---------------------------------------------------------------------------------------------
def _agg_options(name: str, c) -> Dict[str, Any]:
    o = c["opts"]
    kw: Dict[str, Any] = {}
    if name == "fedavg":
        kw["weighting"] = ["samples", "uniform"][o % 2]
    elif name == "fedavgm":
        kw.update(beta=[0.9, 0.0, 0.5, 0.99][o], nesterov=bool(o & 1))
    elif name == "fedaware":
        kw.update(
            [
                {},
                {"warmup": "startup_full"},
                {"warmup": "mask", "normalize": False},
                {"variant": "na", "warmup": "startup_full"},
            ][o]
        )
    elif name == "kuramoto":
        kw["mode"] = ["S", "P", "C", "S"][o]
    elif name == "fednova":
        kw["local_momentum"] = [0.0, 0.9, 0.0, 0.5][o]
    elif name == "fedpvr":
        kw["n_ctrl"] = [1, "all", 1, 2][o]
    elif name == "gcfed":
        kw["vector_policy"] = ["center", "skip", "center", "skip"][o]
    elif name == "local_gc_only":
        kw["lam"] = [0.5, 0.0, 1.0, 0.3][o]
    elif name == "fedecado":
        kw["hessian"] = ["identity", "none", "hutchinson", "identity"][o]
    elif name in ROBUST_OPTIONS:
        kw.update(ROBUST_OPTIONS[name][o])
    return kw


# the robust rules' option sets (by c["opts"]) and the clients each needs per round (their one-line ValueError)
ROBUST_OPTIONS = {
    "trimmed_mean": [{}, {"beta": 0.1}, {"beta": 0.45}, {"beta": 0.0}],
    "krum": [{}, {"f": 1}, {"f": 1, "m": 2}, {"m": 3, "weighting": "uniform"}],
    "bulyan": [{}, {"f": 1}, {}, {"f": 2}],
    "geometric_median": [{}, {"iterations": 1}, {"iterations": 5, "weighting": "uniform"}, {"ftol": 0.0}],
    "centered_clip": [{}, {"tau": 0.5, "iterations": 2}, {"tau": 1e-3}, {"iterations": 3}],
}


def _robust_bound(name: str, kw: Dict[str, Any], e: Exception, K_given: int, K_kept: int) -> bool:
    """Whether ``e`` is a robust rule's one-line refusal of too few clients, and rightly so."""
    f, m = kw.get("f", 0), kw.get("m", 1)
    need = {"krum": max(2 * f + 3, m), "bulyan": 4 * f + 3}.get(name)
    return (
        need is not None
        and isinstance(e, ValueError)
        and "needs K >= " in str(e)
        and str(e).startswith(f"{name}: ")
        and min(K_given, K_kept) < need
    )


def _payloads(name, agg, K, d, dt, g, kw, ids):
    pl = [{} for _ in range(K)]
    if name == "scaffold":
        for p in pl:
            p["delta_c"] = torch.randn(d, generator=g, dtype=torch.float64).to(dt) * 0.1
    elif name == "fedpvr":
        dc = agg.d_c if agg.d_c is not None else d
        for p in pl:
            p["delta_c"] = torch.randn(dc, generator=g, dtype=torch.float64).to(dt) * 0.1
    elif name == "fednova":
        for p in pl:
            p["local_steps"] = int(torch.randint(1, 20, (1,), generator=g))
    elif name == "kuramoto" and kw.get("mode") == "C":
        for p in pl:
            p["phase"] = float(torch.rand(1, generator=g)) * 3
    elif name == "fedecado":
        for p in pl:
            p["T"] = float(torch.rand(1, generator=g)) * 0.5 + 0.05
    elif name == "fedprox":  # what the client rules send to show they ran
        for p in pl:
            p["prox_mu"] = agg.mu
    elif name in ("gcfed", "local_gc", "local_gc_only") and agg.local_layers != "none":
        for p in pl:
            p["local_gc"] = 1
    elif name == "fedpgvc":
        for p in pl:
            p["pgvc_skipped_steps"] = 0
    return pl


AGG_ARG_NAMES = [
    "global_flat",
    "updates",
    "num_examples",
    "client_ids",
    "payload",
    "num_clients",
    "d=",
    "delta_c",
    "local_steps",
    "phase",
    "'T'",
    "FlatSpec",
    "momentum table",
]


def _round_inputs(g, c, name, agg, kw, N, last):
    K, d = c["K"], c["d"]
    dt = FLOATS[c["dtype"]]
    x = _values(g, (d,), dt, "normal")
    U = _values(g, (K, d), dt, c["values"])
    if c["values"] == "normal":
        U = (U.to(torch.float64) * 0.1).to(dt)
    U = _layout(g, U, c["layout"])
    n = (torch.randint(1, 100, (K,), generator=g)).tolist()
    ids = sorted(torch.randperm(N, generator=g)[:K].tolist())
    pl = _payloads(name, agg, K, d, dt, g, kw, ids)
    mut = c["mutation"] if last else None
    natural_bad = [k for k in range(K) if not bool(torch.isfinite(U[k].to(torch.float64)).all())]
    args = {"global_flat": x, "updates": U, "num_examples": n, "client_ids": ids, "payloads": pl}
    bad_rows: List[int] = []
    expect = "valid"
    if mut in ("nan_rows", "inf_rows") and d > 0:
        U = U.clone()
        r = torch.randint(0, K, (1,), generator=g).item()
        U[r, d // 2] = float("nan") if mut == "nan_rows" else float("inf")
        bad_rows = [r]
        args["updates"] = U
        expect = "bad_rows"
    elif mut == "all_bad" and d > 0:
        U = U.clone()
        U[:, 0] = float("nan")
        bad_rows = list(range(K))
        args["updates"] = U
        expect = "bad_rows"
    elif mut == "payload_nan" and name in ("scaffold", "fedpvr") and pl[0]["delta_c"].numel():
        bad_rows = [0]
        pl[0]["delta_c"] = torch.full_like(pl[0]["delta_c"], float("nan"))
        expect = "bad_rows"
    elif mut == "payload_missing" and any(pl):
        pl[K - 1] = {}
        bad_rows = [K - 1]
        expect = "bad_rows"
    elif mut in ("n_neg", "n_zero", "n_nan"):
        n[0] = {"n_neg": -3, "n_zero": 0, "n_nan": float("nan")}[mut]
        bad_rows = [0]
        expect = "bad_rows"
    elif mut == "wrong_d":
        args["updates"] = _values(g, (K, d + 1), dt, "normal")
        expect = "reject"
    elif mut == "list_bad_len":
        lst = list(U.unbind(0))
        lst[0] = torch.zeros(d + 2, dtype=dt)
        args["updates"] = lst
        expect = "bad_rows_or_reject"
        bad_rows = [0]
    elif mut == "list_nontensor":
        lst = list(U.unbind(0))
        lst[-1] = [0.0] * d
        args["updates"] = lst
        expect = "bad_rows_or_reject"
        bad_rows = [K - 1]
    elif mut == "dtype_mismatch":
        args["updates"] = U.to(torch.float64 if dt != torch.float64 else torch.float32)
        expect = "reject"
    elif mut == "int_dtype":
        args["global_flat"] = x.round().to(torch.int64)
        args["updates"] = U.nan_to_num(0, 0, 0).round().to(torch.int64)
        expect = "reject"
    elif mut == "n_len":
        args["num_examples"] = n + [1]
        expect = "reject"
    elif mut == "n_none":
        args["num_examples"] = None
        expect = "reject"
    elif mut == "n_str":
        args["num_examples"] = ["a"] * K
        expect = "reject"
    elif mut == "ids_len":
        args["client_ids"] = ids + [N + 7]
        expect = "reject"
    elif mut == "ids_dup" and K > 1:
        args["client_ids"] = [ids[0]] * K
        expect = "reject"
    elif mut == "ids_range":
        args["client_ids"] = ids[:-1] + [N + 1000]
        expect = "reject_if_N"
    elif mut == "ids_str":
        args["client_ids"] = ["a"] * K
        expect = "reject"
    elif mut == "ids_float":
        args["client_ids"] = [i + 0.5 for i in ids]
        expect = "reject_or_valid"
    elif mut == "payload_len":
        args["payloads"] = pl + [{}]
        expect = "reject"
    elif mut == "global_nan" and d > 0:
        x = x.clone()
        x[0] = float("nan")
        args["global_flat"] = x
        expect = "reject"
    elif mut == "global_2d":
        args["global_flat"] = x.reshape(1, d)
        expect = "reject"
    elif mut == "global_list":
        args["global_flat"] = x.tolist()
        expect = "reject"
    elif mut == "updates_none":
        args["updates"] = None
        expect = "reject"
    elif mut == "K0":
        args["updates"] = U[:0]
        args["num_examples"], args["client_ids"], args["payloads"] = [], [], []
        expect = "empty"
        natural_bad = []
    if natural_bad and expect in ("valid", "bad_rows", "bad_rows_or_reject"):  # e.g. "scaled" values overflowing fp16
        bad_rows = sorted(set(bad_rows) | set(natural_bad))
        expect = "bad_rows"
    elif natural_bad and expect in ("reject_if_N", "reject_or_valid"):  # accepted: those rows are bad clients
        bad_rows = sorted(set(bad_rows) | set(natural_bad))
    return args, expect, bad_rows


def _sum_rows64(U64, coef, rows=None):
    if rows is not None:
        U64 = U64[rows]
    return (coef[:, None] * U64).sum(0) if U64.size(0) else torch.zeros(U64.size(1), dtype=torch.float64)


def _agg_expected(name, agg, kw, x, U, n, pl, info, c, state):
    """float64 recomputation of the new global where simple; None where only invariants apply."""
    x64, U64 = x.to(torch.float64), U.to(torch.float64)
    K = U.size(0)
    n64 = torch.as_tensor(n, dtype=torch.float64)
    lr = c["server_lr"]
    uniform = torch.full((K,), 1.0 / K, dtype=torch.float64)
    samples = n64 / n64.sum()
    if name in ("fedavg", "fedprox", "scaffold"):
        default = "uniform" if name == "scaffold" else "samples"  # SCAFFOLD: the paper's 1/|S|
        p = uniform if kw.get("weighting", default) == "uniform" else samples
        return x64 + lr * _sum_rows64(U64, p), (p.abs()[:, None] * U64.abs()).sum(0)
    if name in ("fedpgvc", "fedpvr", "local_gc", "local_gc_only"):
        return x64 + lr * _sum_rows64(U64, uniform), (uniform[:, None] * U64.abs()).sum(0)
    if name == "fedavgm":
        mean = _sum_rows64(U64, samples)
        v = state.get("v")
        v = mean if v is None else kw["beta"] * v + mean
        state["v"] = v
        step = kw["beta"] * v + mean if kw["nesterov"] else v
        scale = state.get("vscale", torch.zeros_like(mean)) * kw["beta"] + (samples[:, None] * U64.abs()).sum(0)
        state["vscale"] = scale
        return x64 + lr * step, 2 * scale
    if name == "fednova":
        a = torch.tensor(info["a_norm"], dtype=torch.float64)
        tau = float((samples * a).sum())
        coef = samples * tau / a
        return x64 + lr * _sum_rows64(U64, coef), (coef.abs()[:, None] * U64.abs()).sum(0)
    if name == "kuramoto":
        w = torch.tensor(info["weights"], dtype=torch.float64)
        mode = info["mode"]
        if mode == "C":
            return None, None
        alpha = lr * (info["kappa"] if mode == "P" else 1.0)
        if mode == "P" and info.get("degenerate"):
            pass
        return x64 + alpha * _sum_rows64(U64, w), abs(alpha) * (w.abs()[:, None] * U64.abs()).sum(0)
    if name == "gcfed":
        delta = _sum_rows64(U64, uniform)
        out = delta.clone()
        for e in agg.global_entries(agg.spec):
            out[e.slice] = reference.gc_project([delta[e.slice].view(e.shape)], agg.vector_policy, agg.min_fanin)[
                0
            ].reshape(-1)
        return x64 + lr * out, 4 * (uniform[:, None] * U64.abs()).sum(0).max().expand(
            x.numel()
        ) if x.numel() else torch.zeros(0, dtype=torch.float64)
    if name == "fedaware":
        if info.get("phase") == "explore":
            return x64 + lr * _sum_rows64(U64, samples), (samples[:, None] * U64.abs()).sum(0)
        if "support" in info and "coef" in info and not info.get("fallback"):
            M64 = agg.M.to(torch.float64)
            coef = torch.tensor(info["coef"], dtype=torch.float64)
            rows = torch.tensor(info["support"], dtype=torch.long)
            return (
                x64 + lr * _sum_rows64(M64, coef, rows),
                (coef.abs()[:, None] * M64[rows].abs()).sum(0) if rows.numel() else torch.zeros_like(x64),
            )
        return None, None
    if name in ("median", "trimmed_mean"):  # per column, the mean of the sorted values lo..hi-1
        lo = int(kw.get("beta", 0.2) * K) if name == "trimmed_mean" else (K - 1) // 2
        hi = K - lo if name == "trimmed_mean" else K // 2 + 1
        return x64 + lr * torch.sort(U64, dim=0).values[lo:hi].mean(0), U64.abs().amax(0) if K else x64.abs()
    return None, None


def _run_agg(g, c):
    name = c["target"].split(":", 1)[1]
    kw = _agg_options(name, c)
    dt = FLOATS[c["dtype"]]
    N = c["N"]
    spec = synthetic_spec(c["d"], dt)
    agg = algorithms.build(
        name, on_bad_update=c["policy"], server_lr=1.0 if name == "fedecado" else c["server_lr"], **kw
    )
    if name == "fedecado":
        c = dict(c, server_lr=1.0)
    use_N = name in ("fedaware", "fedecado", "fedpvr") or c["opts"] % 2 == 0
    try:
        agg.setup(
            spec=spec,
            num_clients=N if use_N else None,
            global_flat=torch.zeros(c["d"], dtype=dt) if c["opts"] < 2 or name == "fedpvr" else None,
        )
    except ValueError as e:  # an option the synthetic model cannot satisfy (e.g. n_ctrl > layers)
        why = _clean_rejection(e, [name, "n_ctrl", "FlatSpec", "layer"])
        if why:
            raise Fail(f"setup: {why}")
        return "rejected"
    state: Dict[str, Any] = {}
    names = AGG_ARG_NAMES + [name, agg.name]
    for r in range(c["rounds"]):
        last = r == c["rounds"] - 1
        args, expect, bad_rows = _round_inputs(g, c, name, agg, kw, N, last)
        gl = args["global_flat"]
        g_before = gl.clone() if isinstance(gl, torch.Tensor) else None
        try:
            res = agg.aggregate(**args)
        except Exception as e:  # noqa: BLE001 - classified here
            why = _clean_rejection(e, names)
            if why:
                raise Fail(f"round {r}: {why}\n{traceback.format_exc(limit=4)}")
            K_given = (
                len(args["updates"])
                if isinstance(args["updates"], (list, tuple))
                else (
                    args["updates"].size(0)
                    if isinstance(args["updates"], torch.Tensor) and args["updates"].dim() == 2
                    else 0
                )
            )
            if _robust_bound(name, kw, e, K_given, K_given - len(set(bad_rows))):
                return "rejected"
            if expect == "valid" and not (c["layout"] == "expanded" or c["d"] == 0):
                raise Fail(f"round {r}: valid input rejected: {type(e).__name__}: {e}")
            if expect == "bad_rows" and c["policy"] == "exclude":
                raise Fail(f"round {r}: bad rows with on_bad_update='exclude' raised {type(e).__name__}: {e}")
            if expect == "bad_rows" and not isinstance(e, BadUpdateError):
                raise Fail(f"round {r}: a bad client raised {type(e).__name__}, expected BadUpdateError: {e}")
            return "rejected"
        if expect in ("reject",) or (expect == "reject_if_N" and use_N):
            raise Fail(f"round {r}: invalid input ({c['mutation']}) accepted")
        if expect == "bad_rows" and c["policy"] == "raise":
            raise Fail(f"round {r}: bad rows {bad_rows} accepted with on_bad_update='raise'")
        new, info = res.params, res.info
        if not isinstance(new, torch.Tensor) or new.shape != gl.shape or new.dtype != gl.dtype:
            raise Fail(
                f"round {r}: result {getattr(new, 'dtype', type(new))} {tuple(getattr(new, 'shape', ()))}, "
                f"expected {gl.dtype} {tuple(gl.shape)}"
            )
        if not torch.equal(gl, g_before):
            raise Fail(f"round {r}: aggregate modified global_flat in place")
        U = args["updates"]
        if isinstance(U, list):
            keep = [k for k in range(len(U)) if k not in bad_rows]
            U = torch.stack([U[k] if k in keep else gl.new_zeros(gl.numel()) for k in range(len(U))])
        keep = [k for k in range(U.size(0)) if k not in bad_rows]
        if len(keep) == 0:
            if not torch.equal(new, gl):
                raise Fail(f"round {r}: every client excluded but the global model changed")
            if not info.get("skipped"):
                raise Fail(f"round {r}: every client excluded but info has no 'skipped'")
            continue
        ex = info.get("excluded", [])
        if bad_rows and len(ex) != len(set(bad_rows)):
            raise Fail(f"round {r}: {len(set(bad_rows))} bad clients but {len(ex)} excluded: {ex}")
        Uk = U[keep]
        nk = [args["num_examples"][k] for k in keep] if isinstance(args["num_examples"], list) else None
        plk = [args["payloads"][k] for k in keep]
        finite_in = bool(torch.isfinite(Uk.to(torch.float64)).all()) and bool(torch.isfinite(gl).all())
        big = float(Uk.to(torch.float64).abs().max()) if Uk.numel() and finite_in else 0.0
        if name in ("fedadam", "fedyogi", "fedadagrad") and big * big * Uk.size(0) ** 2 * 4 >= torch.finfo(dt).max:
            # the second moment holds squares of the step in the parameters' dtype (as Flower's does):
            # once they leave its range the state is Inf/NaN for the rounds after, as in Flower
            state["squares_overflowed"] = True
        if finite_in and not bool(torch.isfinite(new).all()) and not state.get("squares_overflowed"):
            if big * Uk.size(0) * 4 < torch.finfo(dt).max and not info.get("failed"):
                raise Fail(f"round {r}: finite inputs gave a non-finite global (info {sorted(info)})")
        if name == "fedecado" and info.get("failed") and not torch.equal(new, gl):
            raise Fail(f"round {r}: fedecado reported failure but changed the global")
        exp, scale = _agg_expected(name, agg, kw, gl, Uk, nk, plk, info, c, state)
        if exp is not None:
            acc = _acc_dtype(dt) if name not in ("fedavgm", "fedaware", "gcfed") else dt  # state kept in dt
            Kk = Uk.size(0)
            tol = (
                (Kk + 8) * 4 * _eps(acc) * (scale * abs(c["server_lr"]) + gl.to(torch.float64).abs())
                + 4 * _eps(dt) * exp.abs()
                + 8 * torch.finfo(dt).tiny
            )
            may = (
                ~torch.isfinite(scale) | (scale * 4 >= torch.finfo(acc).max) | (exp.abs() * 1.01 >= torch.finfo(dt).max)
            )
            _check_close(f"{name} round {r}", new, exp, tol, may)
    return "ok"


# ---------------------------------------------------------------------------------------------
# execution and classification
# ---------------------------------------------------------------------------------------------
OP_ARG_NAMES = {
    **{
        n: [n, "U", "rows", "lo", "hi", "beta"]
        for n in ("order_mean", "order_mean_screened", "closest_mean", "closest_mean_screened")
    },
    "gram": ["gram", "U", "rows"],
    "weighted_sum": ["weighted_sum", "U", "coef", "base", "alpha", "rows", "out"],
    "weighted_sum_chunked": ["weighted_sum_chunked", "M", "coef", "base", "alpha", "rows", "out_dtype", "chunk_cols"],
    "finite_rows": ["finite_rows", "U"],
    "min_norm": ["min_norm", "G", "max_iter", "tol", "method", "init", "lam0"],
    "gc_project": ["gc_project", "tensors", "vector_policy", "min_fanin"],
    "gc_project_": ["gc_project_", "tensors", "vector_policy", "min_fanin"],
    "gc_project_flat_": ["gc_project_flat_", "vec", "vector_policy", "min_fanin"],
    "lu_factor": ["lu_factor", "A"],
    "lu_factor_ex": ["lu_factor_ex", "A"],
    "arrowhead_solve": ["arrowhead_solve", "R", "r0", "a", "b", "c", "alpha"],
    "fedecado_be_step": [
        "fedecado_be_step",
        "xc",
        "Icur",
        "xc0",
        "U",
        "Ik",
        "S_off",
        "theta_new",
        "theta_old",
        "inv_g",
        "dt",
        "L",
        "out",
    ],
    "fused_sgd_step_": [
        "fused_sgd_step_",
        "params",
        "grads",
        "momentum",
        "lr",
        "c_add",
        "c_sub",
        "gc_mask",
        "weight_decay",
    ],
    "corrected_sgd_step_": [
        "corrected_sgd_step_",
        "fused_sgd_step_",
        "params",
        "grads",
        "momentum",
        "lr",
        "c",
        "subset",
        "weight_decay",
    ],
    "gc_sgd_step_": ["gc_sgd_step_", "fused_sgd_step_", "params", "grads", "momentum", "lr", "gc_mask", "weight_decay"],
    "dot": ["dot", "a", "b"],
    "sqnorm": ["sqnorm", "a"],
    "all_": ["all_", "mask"],
    "any_": ["any_", "mask"],
    "any_flag": ["any_flag", "mask"],
    "amax_d": ["amax_d", "x"],
    "mean_d": ["mean_d", "x"],
    "lu_solve": ["lu_solve", "lu_factor", "LU", "piv", "pivots", "B"],
    "server_opt_step_": ["server_opt_step_", "io", "m", "v", "x", "rule", "lr", "beta_1", "beta_2", "tau"],
    "dequant_weighted_sum": ["dequant_weighted_sum"],
    "sparse_weighted_sum": ["sparse_weighted_sum"],
}


def execute(case: Dict[str, Any]) -> Tuple[str, str]:
    """('ok' | 'rejected' | 'fail', detail) for one case."""
    g = torch.Generator().manual_seed(int(case["seed"]))
    kind, name = case["target"].split(":", 1)
    try:
        if kind == "agg":
            return _run_agg(g, case), ""
        return globals()["_run_" + name](g, case), ""
    except Fail as f:
        return "fail", str(f)
    except Exception as e:  # noqa: BLE001
        if kind == "agg":
            return "fail", f"{type(e).__name__} outside aggregate: {e}\n{traceback.format_exc(limit=6)}"
        why = _clean_rejection(e, OP_ARG_NAMES.get(name, [name]))
        if why:
            return "fail", why + "\n" + traceback.format_exc(limit=6)
        return "rejected", f"{type(e).__name__}: {str(e)[:200]}"


# ---------------------------------------------------------------------------------------------
# compressed rows: dequant_weighted_sum (int8 / fp8 blocks) and sparse_weighted_sum (index/value lists)
# ---------------------------------------------------------------------------------------------
def _gen_dequant_weighted_sum(rnd, c):
    c["K"] = _K(rnd)
    c["d"] = _d(rnd, c["K"])
    c["code"] = rnd.choice(["int8"] * 5 + ["fp8"] * 5 + ["fp32"])
    c["block"] = rnd.choice([1, 2, 3, 7, 64, 100, 4096] * 3 + [0, -3, 2.5])
    c["scales"] = rnd.choice(["ok"] * 8 + ["nan", "inf", "huge", "zeros", "wrong_shape", "f64"])
    c["codes"] = rnd.choice(["random", "random", "extreme", "nan_code"])
    c["layout"] = rnd.choice(["contig", "contig", "colslice"])
    c["rows"] = rnd.choice([None] * 4 + ["subset", "subset", "dups", "empty", "bad_range"])
    c["coef"] = rnd.choice(["f64"] * 6 + ["big", "neg", "neg", "nan", "wrong_len"])
    c["alpha"] = rnd.choice([1.0] * 5 + [0.0, -0.5, 1e30, float("nan")])
    c["result"] = rnd.choice(["default", "default", "f64", "base32", "base32", "base64", "base16", "conflict"])


def _dq_rows(g, c, K):
    kind = c["rows"]
    if kind is None:
        return None
    if kind == "empty":
        return []
    if kind == "bad_range":
        return [0, K]
    if K == 0:
        return []
    n = int(torch.randint(1, K + 1, (1,), generator=g))
    r = torch.randint(0, K, (n,), generator=g).tolist()
    return r if kind == "dups" else sorted(set(r))


def _compressed_coef(g, kind: str, n: int) -> torch.Tensor:
    return {
        "f64": lambda: torch.rand(n, generator=g, dtype=torch.float64),
        "big": lambda: torch.full((n,), 1e30, dtype=torch.float64),
        "neg": lambda: -torch.rand(n, generator=g, dtype=torch.float64),
        "nan": lambda: torch.full((n,), float("nan"), dtype=torch.float64),
        "wrong_len": lambda: torch.ones(n + 1, dtype=torch.float64),
    }[kind]()


def _run_dequant_weighted_sum(g, c):
    """(out, ok) vs the float64 reference: flags exactly; out within (n + 2) eps of the accumulation type times
    the sum of magnitudes (one rounding per weight, one fma per code); non-finite exactly where the reference is,
    except where a partial sum may pass float32's range."""
    K, d, block = c["K"], c["d"], c["block"]
    bad_block = not isinstance(block, int) or block < 1
    nb = -(-d // block) if not bad_block else 1
    if c["code"] == "int8":
        Q = torch.randint(-128, 128, (K, d + 3), generator=g).to(torch.int8)
        if c["codes"] == "extreme":
            Q.fill_(-128)
    else:
        Q = (torch.randn(K, d + 3, generator=g, dtype=torch.float64) * 60).to(torch.float32)
        if c["codes"] == "extreme":
            Q.fill_(448.0)
        if c["code"] == "fp8":
            Q = Q.to(torch.float8_e4m3fn)
            if c["codes"] == "nan_code" and K and d:
                Q.view(torch.uint8)[int(torch.randint(0, K, (1,), generator=g)), 0] = 0xFF
    Q = Q[:, :d] if c["layout"] == "contig" else Q[:, 3 : 3 + d]
    if c["layout"] == "contig":
        Q = Q.contiguous()
    S = torch.rand(K, nb, generator=g) * 0.01
    if K and nb:
        if c["scales"] == "nan":
            S[int(torch.randint(0, K, (1,), generator=g)), -1] = float("nan")
        elif c["scales"] == "inf":
            S[0, 0] = float("inf")
        elif c["scales"] == "huge":
            S.fill_(3e38)
        elif c["scales"] == "zeros":
            S.zero_()
    if c["scales"] == "wrong_shape":
        S = torch.rand(K, nb + 1, generator=g)
    elif c["scales"] == "f64":
        S = S.double()
    rows = _dq_rows(g, c, K)
    n = K if rows is None else len(rows)
    coef = _compressed_coef(g, c["coef"], n)
    kw: Dict[str, Any] = {}
    res = c["result"]
    if res == "f64":
        kw["out_dtype"] = torch.float64
    elif res.startswith("base"):
        kw["base"] = torch.randn(d, generator=g).to(
            {"base32": torch.float32, "base64": torch.float64, "base16": torch.float16}[res]
        )
    elif res == "conflict":
        kw["base"], kw["out_dtype"] = torch.zeros(d), torch.float64
    out, ok = ops.dequant_weighted_sum(Q, S, coef, block, alpha=c["alpha"], rows=rows, **kw)
    invalid = [
        why
        for why, bad in (
            ("code dtype", c["code"] == "fp32"),
            ("block", bad_block),
            ("scales", c["scales"] in ("wrong_shape", "f64")),
            ("rows", c["rows"] == "bad_range"),
            ("coef", c["coef"] == "wrong_len" or c["coef"] == "nan" and n > 0),
            ("alpha", c["alpha"] != c["alpha"]),
            ("result", res in ("base16", "conflict")),
        )
        if bad
    ]
    if invalid:
        raise Fail(f"dequant_weighted_sum accepted an invalid {invalid[0]}")
    want, wok = reference.dequant_weighted_sum(Q, S, coef, block, kw.get("base"), c["alpha"], rows)
    if ok.dtype != torch.bool or not torch.equal(ok, wok):
        raise Fail(f"dequant_weighted_sum: flags {ok.tolist()[:8]} != reference {wok.tolist()[:8]}")
    odt = out.dtype
    if odt != (kw["base"].dtype if "base" in kw else kw.get("out_dtype", torch.float32)):
        raise Fail(f"dequant_weighted_sum: result dtype {odt}")
    A = reference.dequantize_blocks(Q, S, block).abs()
    r = torch.arange(K) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    mag = (coef.abs() * abs(c["alpha"])) @ A[r] if n else torch.zeros(d, dtype=torch.float64)
    if "base" in kw:
        mag = mag + kw["base"].double().abs()
    tol = (n + 2) * _eps(odt) * mag + 1e-300
    _check_close("dequant_weighted_sum", out, want, tol, ~torch.isfinite(mag) | (mag > 1e38))
    return "ok"


def _gen_sparse_weighted_sum(rnd, c):
    c["K"] = _K(rnd)
    c["d"] = rnd.choice([0, 1, 2, 7, 100, 5000, 20000])
    c["nnz"] = rnd.choice([0, 1, 5, 50, 2000])
    c["idx"] = rnd.choice(["i64"] * 4 + ["i32"] * 4 + ["f32"])
    c["val"] = rnd.choice(["fp32"] * 4 + ["fp64", "fp64", "bf16", "fp16", "i64"])
    c["order"] = rnd.choice(["sorted"] * 8 + ["unsorted", "out_of_range", "negative"])
    c["values"] = rnd.choice(["normal"] * 4 + ["nan", "inf", "huge"])
    c["offsets"] = rnd.choice(["ok"] * 8 + ["not_zero", "short", "decreasing", "float"])
    c["rows"] = rnd.choice([None] * 4 + ["subset", "subset", "dups", "empty", "bad_range"])
    c["coef"] = rnd.choice(["f64"] * 6 + ["big", "neg", "neg", "nan", "wrong_len"])
    c["alpha"] = rnd.choice([1.0] * 5 + [0.0, -0.5, 1e30, float("nan")])
    c["result"] = rnd.choice(["default", "default", "f64", "base32", "base32", "base64", "base16"])


def _run_sparse_weighted_sum(g, c):
    """(out, ok) vs the float64 reference (lists densified by index_add_): flags exactly; out within
    (n m + 2) eps times the sum of magnitudes (m: the longest list), NaN/Inf where the reference has them."""
    K, d = c["K"], c["d"]
    lens = [int(torch.randint(0, c["nnz"] + 1, (1,), generator=g)) if d else 0 for _ in range(K)]
    idx_l = [torch.randint(0, max(d, 1), (m,), generator=g).sort().values for m in lens]
    off = torch.tensor([0] + lens).cumsum(0)
    idx = torch.cat(idx_l) if K else torch.zeros(0, dtype=torch.int64)
    nnz = idx.numel()
    vdt = {
        "fp32": torch.float32,
        "fp64": torch.float64,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "i64": torch.int64,
    }[c["val"]]
    val = torch.randn(nnz, generator=g, dtype=torch.float64)
    if nnz:
        if c["values"] == "nan":
            val[int(torch.randint(0, nnz, (1,), generator=g))] = float("nan")
        elif c["values"] == "inf":
            val[-1] = float("-inf")
        elif c["values"] == "huge":
            val.fill_(3e38)
    val = val.to(vdt) if vdt != torch.int64 else val.nan_to_num().clamp(-1e9, 1e9).to(torch.int64)
    broken = None
    if nnz and c["order"] == "unsorted" and any(m >= 2 and bool((t[1:] > t[:-1]).any()) for m, t in zip(lens, idx_l)):
        for k, t in enumerate(idx_l):
            if lens[k] >= 2 and bool((t[1:] > t[:-1]).any()):
                a = int(off[k])
                idx[a : a + lens[k]] = idx[a : a + lens[k]].flip(0)
                broken = "order"
                break
    elif nnz and c["order"] == "out_of_range":
        idx[-1], broken = d, "range"
    elif nnz and c["order"] == "negative":
        idx[0], broken = -1, "range"
    idx = {"i64": idx, "i32": idx.to(torch.int32), "f32": idx.float()}[c["idx"]]
    offsets: Any = off
    if c["offsets"] == "not_zero":
        offsets = off + 1
    elif c["offsets"] == "short":
        offsets = off[:-1] if K else torch.tensor([1])
    elif c["offsets"] == "decreasing" and K >= 2 and lens[0] > 0:
        offsets = off.clone()
        offsets[1] = nnz + 1
    elif c["offsets"] == "float":
        offsets = off.double()
    K_seen = offsets.numel() - 1 if isinstance(offsets, torch.Tensor) else K
    rows = _dq_rows(g, c, K_seen)
    n = K_seen if rows is None else len(rows)
    coef = _compressed_coef(g, c["coef"], n)
    kw: Dict[str, Any] = {}
    if c["result"] == "f64":
        kw["out_dtype"] = torch.float64
    elif c["result"].startswith("base"):
        kw["base"] = torch.randn(d, generator=g).to(
            {"base32": torch.float32, "base64": torch.float64, "base16": torch.float16}[c["result"]]
        )
    out, ok = ops.sparse_weighted_sum(idx, val, offsets, coef, d, alpha=c["alpha"], rows=rows, **kw)
    offsets_bad = (
        c["offsets"] in ("not_zero", "float")
        or (c["offsets"] == "short" and (K == 0 or nnz != int(off[-2])))
        or (c["offsets"] == "decreasing" and K >= 2 and lens[0] > 0)
    )
    invalid = [
        why
        for why, bad in (
            ("idx dtype", c["idx"] == "f32"),
            ("val dtype", c["val"] == "i64"),
            ("index", broken is not None),
            ("offsets", offsets_bad),
            ("rows", c["rows"] == "bad_range"),
            ("coef", c["coef"] == "wrong_len" or c["coef"] == "nan" and n > 0),
            ("alpha", c["alpha"] != c["alpha"]),
            ("base", c["result"] == "base16"),
        )
        if bad
    ]
    if invalid:
        raise Fail(f"sparse_weighted_sum accepted an invalid {invalid[0]} ({c})")
    want, wok = reference.sparse_weighted_sum(idx, val, offsets, coef, d, kw.get("base"), c["alpha"], rows)
    if ok.dtype != torch.bool or not torch.equal(ok, wok):
        raise Fail(f"sparse_weighted_sum: flags {ok.tolist()[:8]} != reference {wok.tolist()[:8]}")
    o = offsets.tolist()
    dense = torch.zeros(K_seen, d, dtype=torch.float64)
    for k in range(K_seen):
        dense[k].index_add_(0, idx[o[k] : o[k + 1]].long(), val[o[k] : o[k + 1]].double().abs())
    r = torch.arange(K_seen) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    mag = (coef.abs() * abs(c["alpha"])) @ dense[r] if n else torch.zeros(d, dtype=torch.float64)
    if "base" in kw:
        mag = mag + kw["base"].double().abs()
    m = max([o[k + 1] - o[k] for k in range(K_seen)] + [1])
    tol = (n * m + 2) * _eps(out.dtype) * mag + 1e-300
    _check_close("sparse_weighted_sum", out, want, tol, ~torch.isfinite(mag) | (mag > 1e38))
    return "ok"
