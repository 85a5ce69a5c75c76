"""FedECADO's options and the federation's tables, apart from the method (fedecado/__init__.py).

* :class:`Stepping` - the server's time stepping (spec §2.7, §3); :class:`Ablations` - the spec's
  [OURS] choices where the paper is ambiguous, with ``Ablations.PAPER_LITERAL`` the paper's literal
  form; ``SOLVERS`` - the BE linear solve. :func:`split_flat` takes the groups' fields given flat
  (as configs pass them) out of the keyword options; :func:`flat_signature` shows them in the
  constructor's signature; :func:`integrator_options` passes them on to the integrator.
* :func:`federation_size`, :func:`gradient_weights`, :func:`hbar_table` - N, the gradient weights
  w_i (§2.11) and the per-client Hessian scalars from the constructor's ``num_clients`` /
  ``weights`` / ``data_sizes`` / ``hbar``.
* :class:`FederationTables` - the per-client tables (w, hbar, flows I, S_all) set up before the first
  round, and the payload check; :func:`check_payload` - what a client must send (T, optionally hbar); :func:`hutchinson_hbar` -
  the client's Hessian scalar estimate (spec §2.5).
"""

from __future__ import annotations

import inspect
import math
import typing
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import payload_numbers, rows_where
from ..parts import check_choice

INACTIVE = ("frozen", "exclude")
HESSIANS = ("hutchinson", "identity", "global", "none")
SOLVERS = ("auto", "fused", "closed_form", "lu")


@dataclass(frozen=True)
class Stepping:
    """The server's time stepping (spec §2.7, §3): inductance ``L`` (None: c_L * T_bar^2 with T_bar
    from ``T_bar`` or round 1's T_max, re-set once to the median of the first 5 rounds), LTE
    tolerances ``delta`` / ``delta_I`` (None = delta; math.inf = fixed steps) measured in ``lte_norm``
    (inf | rms), first step ``dt0`` (None: T_max), backtracking factor ``beta``, step ``growth`` per
    round, and the caps ``max_backtracks`` / ``max_steps``."""

    L: Optional[float] = None
    c_L: float = 2.0
    T_bar: Optional[float] = None
    delta: float = 1e-2
    delta_I: Optional[float] = None
    dt0: Optional[float] = None
    beta: float = 0.5
    growth: float = 1.0
    max_backtracks: int = 30
    max_steps: int = 1000
    lte_norm: str = "inf"

    def __post_init__(self):
        n = "fedecado"
        if self.L is not None and not self.L > 0:
            raise ValueError(f"{n}: L must be > 0, got {self.L!r}")
        if not self.c_L > 0:
            raise ValueError(f"{n}: c_L must be > 0, got {self.c_L!r}")
        if not self.delta > 0 or (self.delta_I is not None and not self.delta_I > 0):
            raise ValueError(
                f"{n}: delta and delta_I must be > 0 (math.inf = fixed step), got {self.delta!r}, {self.delta_I!r}"
            )
        if not 0 < self.beta < 1:
            raise ValueError(f"{n}: beta must lie in (0, 1), got {self.beta!r}")
        if not self.growth >= 1.0:
            raise ValueError(f"{n}: growth must be >= 1, got {self.growth!r}")
        if self.dt0 is not None and not self.dt0 > 0:
            raise ValueError(f"{n}: dt0 must be > 0, got {self.dt0!r}")
        if int(self.max_backtracks) < 0 or int(self.max_steps) < 1:
            raise ValueError(f"{n}: max_backtracks >= 0 and max_steps >= 1 required")
        check_choice(n, "lte_norm", self.lte_norm, ("inf", "rms"))


@dataclass(frozen=True)
class Ablations:
    """Where the paper is ambiguous or an experiment switches a part off (spec §2.4, §2.5, §2.10,
    §2.11, §8). Defaults are the spec's [OURS] choices; ``Ablations.PAPER_LITERAL`` is the paper's
    literal form: gradient weights w_i = p_i (``grad_weight="paper"``; an exact reparametrisation of
    the default N p_i) and client time T_i = lr_i * epochs (``time_unit="epoch"``).

    ``extrap`` linear | hold, ``max_extrap_ratio`` (inf), ``inactive`` frozen | exclude (flows of
    non-participants), ``grad_weight`` normalized | paper, ``hessian`` hutchinson | identity | global |
    none (none = ECADO limit, 1/g = 0), ``time_unit`` lr_sum | epoch, ``sync`` (True: "no multi-rate",
    every active client's T_i is taken as the round's T_max)."""

    extrap: str = "linear"
    max_extrap_ratio: float = math.inf
    inactive: str = "frozen"
    grad_weight: str = "normalized"
    hessian: str = "hutchinson"
    time_unit: str = "lr_sum"
    sync: bool = False

    def __post_init__(self):
        n = "fedecado"
        for opt, allowed in (
            ("extrap", ("linear", "hold")),
            ("inactive", INACTIVE),
            ("grad_weight", ("normalized", "paper")),
            ("hessian", HESSIANS),
            ("time_unit", ("lr_sum", "epoch")),
        ):
            check_choice(n, opt, getattr(self, opt), allowed)
        if not self.max_extrap_ratio >= 1.0:
            raise ValueError(f"{n}: max_extrap_ratio must be >= 1, got {self.max_extrap_ratio!r}")
        if not isinstance(self.sync, bool):
            raise ValueError(f"{n}: sync must be True or False, got {self.sync!r}")


Ablations.PAPER_LITERAL = Ablations(grad_weight="paper", time_unit="epoch")
_GROUPS = (Stepping, Ablations)


def integrator_options(stepping: Stepping, ablations: Ablations, solver: str, carried: bool) -> Dict[str, Any]:
    """The keyword options of ``solver.central_round`` from the groups (``carried``: dt
    comes from the previous round, so the step may grow)."""
    return dict(
        delta_I=stepping.delta_I,
        beta=stepping.beta,
        growth=stepping.growth if carried else 1.0,
        max_backtracks=stepping.max_backtracks,
        max_steps=stepping.max_steps,
        extrap=ablations.extrap,
        max_extrap_ratio=ablations.max_extrap_ratio,
        lte_norm=stepping.lte_norm,
        sensitivity=ablations.hessian != "none",
        solver=solver,
    )


def split_flat(options: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Pops the Stepping and the Ablations fields given flat out of ``options``."""
    return tuple({f.name: options.pop(f.name) for f in fields(cls) if f.name in options} for cls in _GROUPS)


def flat_signature(init) -> inspect.Signature:
    """``init``'s signature with the groups' fields as keyword options (what configs may pass flat),
    so tools that read constructor signatures (config checks, help) see every option."""
    sig = inspect.signature(init)
    ps = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    ps += [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=typing.get_type_hints(cls)[f.name]
        )  # checked by build
        for cls in _GROUPS
        for f in fields(cls)
    ]
    ps += [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
    return sig.replace(parameters=ps)


# float64 elements of one column chunk of flow_sum's conversion (2 MB on the CPU: cache-sized; larger
# elsewhere, where each chunk is a kernel launch)
FLOW_SUM_CHUNK = {"cpu": 1 << 18}
FLOW_SUM_CHUNK_OTHER = 1 << 24


def flow_sum(I: torch.Tensor) -> torch.Tensor:
    """sum_i I_i in float64 ([d]) for flows I [K, d] (S_all's arithmetic): the bits of
    ``I.sum(0, dtype=torch.float64)``, which converts all of I to a K x d float64 temporary first;
    here column chunk by chunk (each column is summed over the same rows in the same order), so the
    temporary is at most a chunk."""
    K, d = I.shape
    B = max(1, FLOW_SUM_CHUNK.get(I.device.type, FLOW_SUM_CHUNK_OTHER) // max(K, 1))
    if d <= B:
        return I.sum(0, dtype=torch.float64)
    out = torch.empty(d, dtype=torch.float64, device=I.device)
    for a in range(0, d, B):
        torch.sum(I[:, a : a + B], 0, dtype=torch.float64, out=out[a : a + B])
    return out


# ---- the federation's tables ----------------------------------------------------------------------
def federation_size(weights, data_sizes, hbar) -> Optional[int]:
    """N from the per-client options (the last one given of weights, data_sizes, a list of hbar)."""
    N = None
    for o in (weights, data_sizes):
        if o is not None:
            N = len(o)
    if isinstance(hbar, (list, tuple)):
        N = len(hbar)
    return N


def gradient_weights(
    name: str, N: int, weights: Optional[Sequence[float]], data_sizes: Optional[Sequence[float]], grad_weight: str
) -> torch.Tensor:
    """[N] float64 w_i (spec §2.11): the explicit ``weights``, else N p_i ("normalized") or p_i
    ("paper") with p_i = n_i / sum n from ``data_sizes`` (uniform p_i = 1/N without them)."""
    if weights is not None:
        w = torch.as_tensor(weights, dtype=torch.float64)
    elif data_sizes is not None:
        n = torch.as_tensor(data_sizes, dtype=torch.float64)
        if n.numel() != N or bool((n < 0).any()) or not float(n.sum()) > 0:
            raise ValueError(f"{name}: data_sizes must be N={N} non-negative numbers with a positive sum")
        w = n / n.sum() * (N if grad_weight == "normalized" else 1.0)
    else:
        w = torch.full((N,), 1.0 if grad_weight == "normalized" else 1.0 / N, dtype=torch.float64)
    if w.numel() != N or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"{name}: weights must be N={N} finite non-negative numbers")
    return w


def hbar_table(name: str, N: int, hbar, hessian: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """([N] float64 hbar_i, [N] bool known): fixed values from ``hbar`` (a float or N floats, clamped
    >= 0), else ones, known up front only when the Hessian model needs no estimate."""
    if hbar is None:
        return torch.ones(N, dtype=torch.float64), torch.full((N,), hessian in ("identity", "none"), dtype=torch.bool)
    tab = (
        torch.as_tensor(hbar, dtype=torch.float64).expand(N).clone()
        if not isinstance(hbar, (list, tuple))
        else torch.as_tensor(hbar, dtype=torch.float64)
    )
    if tab.numel() != N or not bool(torch.isfinite(tab).all()):
        raise ValueError(f"{name}: hbar must be a finite float or N={N} finite floats")
    return tab.clamp(min=0.0), torch.ones(N, dtype=torch.bool)


def check_payload(payload: Dict[str, Any], missing) -> Optional[str]:
    """The reason a client's payload is unusable (``missing(key, what)`` words a missing entry):
    ``T`` finite and > 0 is required, ``hbar`` (when sent) finite."""
    T = payload.get("T")
    if T is None:
        return missing("T", "the client's simulated time, the sum of its applied learning rates")
    try:
        T = float(T)
    except (TypeError, ValueError):
        return f"payload 'T' must be a number, got {type(T).__name__}"
    if not (math.isfinite(T) and T > 0):
        return f"payload 'T' must be finite and > 0, got {T}"
    h = payload.get("hbar")
    if h is not None and not math.isfinite(float(h)):
        return f"payload 'hbar' must be finite, got {h}"
    return None


def hutchinson_hbar(
    loss: torch.Tensor, params: List[torch.Tensor], n_probes: int = 4, generator: Optional[torch.Generator] = None
) -> float:
    """Scalar Hessian model tr(H)/d by Hutchinson with Rademacher probes (spec §2.5), clamped >= 0."""
    grads = torch.autograd.grad(loss, params, create_graph=True)
    d = sum(p.numel() for p in params)
    tot = 0.0
    for _ in range(n_probes):
        vs = [
            (torch.randint(0, 2, p.shape, generator=generator, dtype=torch.int64) * 2 - 1).to(p.dtype).to(p.device)
            for p in params
        ]
        hv = torch.autograd.grad(grads, params, grad_outputs=vs, retain_graph=True)
        tot += float(sum((h * v).sum() for h, v in zip(hv, vs)))
    return max(tot / (n_probes * d), 0.0)


class FederationTables:
    """FedECADO's per-client state, set up before the first round (a base of ``FedECADO``, whose
    constructor sets the attributes used here): N, the gradient weights ``w`` [N] and Hessian
    scalars ``hbar_tab`` / ``hbar_known`` [N] from the options, and, once the model size is known,
    the flows ``I`` [N, d] and ``S_all`` = sum_j I_j [d] (float64). Payloads are checked here too."""

    def setup(self, spec=None, num_clients=None, global_flat=None) -> None:
        super().setup(spec, num_clients if num_clients is not None else self.num_clients, global_flat)
        self._tables()
        if global_flat is not None:
            self._flows(global_flat)

    def _tables(self) -> None:
        if self.num_clients is None:
            self.num_clients = federation_size(self._weights_opt, self._sizes_opt, self._hbar_opt)
        N = self.num_clients
        if N is None:
            return
        if self.w is None:
            self.w = gradient_weights(self.name, N, self._weights_opt, self._sizes_opt, self.ablations.grad_weight)
        if self.hbar_tab is None:
            self.hbar_tab, self.hbar_known = hbar_table(self.name, N, self._hbar_opt, self.ablations.hessian)

    def _flows(self, global_flat: torch.Tensor) -> None:
        if self.num_clients is None:
            raise ValueError(
                f"{self.name}: needs the number of clients N (num_clients=, weights=, data_sizes= "
                f"or setup(num_clients=N))"
            )
        if self.I is None:
            self.I = global_flat.new_zeros((self.num_clients, global_flat.numel()))
            self.S_all = torch.zeros(global_flat.numel(), dtype=torch.float64, device=global_flat.device)

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        return check_payload(payload, self.missing_payload) or super().check_payload(payload)

    _cols = None  # (payloads, their columns): read once per round by suspect_payloads and the round

    def payload_columns(self, payloads: List[Dict[str, Any]]) -> Tuple[Optional[torch.Tensor], List[int]]:
        """(T, sent) over the round: T [K] float64 host (NaN where missing; None when some entry is not
        a plain number), sent = the rows whose payload has an ``hbar``. Read once per round list."""
        if self._cols is not None and self._cols[0] is payloads:
            return self._cols[1]
        hbar = [p.get("hbar") for p in payloads]
        sent = [k for k, h in enumerate(hbar) if h is not None] if hbar.count(None) != len(hbar) else []
        out = (payload_numbers(payloads, "T"), sent)
        self._cols = (payloads, out)
        return out

    def suspect_payloads(self, payloads):
        rows, (T, sent) = super().suspect_payloads(payloads), self.payload_columns(payloads)  # T: NaN where missing
        if rows is None or T is None:
            return None
        if T.numel():  # one whole-round test; the rows only when some T is bad
            lo, hi = torch.aminmax(T)
            if not (float(lo) > 0 and float(hi) < math.inf):  # (a NaN fails both)
                rows = rows + rows_where(~(torch.isfinite(T) & (T > 0)))
        if sent:
            h = payload_numbers([payloads[k] for k in sent], "hbar")
            if h is None:
                return None
            rows += [sent[j] for j in rows_where(~torch.isfinite(h))]
        return rows

    def prepare_round(self, global_flat) -> None:
        self._tables()
        if isinstance(global_flat, torch.Tensor) and global_flat.dim() == 1:
            self._flows(global_flat)
