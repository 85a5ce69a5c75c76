"""Adaptive server optimisers (Reddi et al., 2021, "Adaptive Federated Optimization"): FedAdam,
FedYogi, FedAdagrad, with Flower's option names and defaults (``flwr.server.strategy.FedAdam`` /
``FedYogi`` / ``FedAdagrad``), and the optimiser as a part that any method's aggregate can feed.

In the update convention of fedkernels (U_k = local - global), round t with global model x:

    delta = sum_k p_k U_k                         (FedAvg's weighted mean; p_k = n_k / sum n, as Flower)
    m     = beta_1 m + (1 - beta_1) delta
    v     = beta_2 v + (1 - beta_2) delta^2                   fedadam
            v - (1 - beta_2) delta^2 sign(v - delta^2)        fedyogi
            v + delta^2                                       fedadagrad
    x    <- x + eta_t m / (sqrt(v) + tau)

``eta_t`` is ``eta``, or with ``bias_correction``: ``eta sqrt(1 - beta_2^e) / (1 - beta_1^e)``. Flower's
FedAdam always applies it with e = server_round + 1 (its rounds count from 1: e = 2 in the first
round), which is ``bias_correction=True`` (= ``"flower"``, fedadam's default); ``"adam"`` uses e = t, the
number of steps taken (Kingma & Ba's alpha_t); ``False`` (= ``"none"``) is the paper's Algorithm 2
(fedyogi's and fedadagrad's default, as in Flower, whose FedYogi and FedAdagrad have no correction).

Differences to the paper's Algorithm 2, all following Flower: v starts at 0 (the paper asks
v_{-1} >= tau^2; ``initial_v=tau**2`` gives that), FedAdagrad's beta_1 defaults to 0 (Flower fixes it
at 0; the paper's experiments use momentum 0.9: pass ``beta_1=0.9``), and the step's tau is added
outside the square root. ``eta_l`` (the client learning rate) is recorded, not used, as in Flower:
local training takes its own learning rate (the simulator's ``train.lr``). The common option
``server_lr`` (default 1.0) multiplies eta_t.

Composition: ``server_opt`` is a wrapper option of every method (``fedkernels.algorithms.wrappers``):
``algorithms.build("trimmed_mean", server_opt="adam")`` (or ``{"rule": "adam", "eta": 0.01, ...}``) runs
the method's update, then one step of the optimiser on its pseudo-gradient ``new - x`` (see ``ServerOpt``).

The pseudo-gradient comes from one screened ``weighted_sum`` pass over U (a [d] vector in the
model's dtype, the only temporary), then ``ops.server_opt_step_`` updates m, v and the model in one
fused pass over d, in place in that vector (which becomes the new model). State: m and v ([d],
float32; float64 for a float64 model) and the step count t.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .. import ops
from .base import AggResult, Aggregator, RoundInput, info_values, register
from .fedavg import FedAvg
from .signature import signature_params
from .wrappers import MethodWrapper, register_wrapper

BIAS_CORRECTIONS = ("flower", "adam", "none")


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be a finite number, got {value!r}")
    return float(value)


class ServerOptimizer:
    """The adaptive server optimiser as a part: m, v ([d]) and the step count t, and one fused step.

    ``rule``: "adam" | "yogi" | "adagrad"; ``eta`` > 0, ``beta_1`` in [0, 1), ``beta_2`` in [0, 1)
    (unused by adagrad), ``tau`` > 0, ``bias_correction``: True / "flower", "adam", False / "none"
    (see the module docstring), ``initial_v`` >= 0 (the value v starts from). ``owner`` names the
    method in the one-line ValueErrors.

    ``step_(x, io, round_index, from_model=False)``: ``io`` holds the pseudo-gradient (aggregate - x)
    (or, with ``from_model``, an inner method's new model, the pseudo-gradient being io - x) and
    becomes the new model, in place; m, v and t advance. Any method can follow its own aggregate
    with it (e.g. a trimmed mean followed by an Adam step: ``opt.step_(x, new, r, from_model=True)``).
    """

    def __init__(
        self,
        rule: str,
        eta: float,
        beta_1: float,
        beta_2: float,
        tau: float,
        bias_correction: Union[bool, str] = False,
        initial_v: float = 0.0,
        owner: str = "server_opt",
    ):
        if rule not in ops.SERVER_OPT_RULES:
            raise ValueError(f"{owner}: rule must be one of {ops.SERVER_OPT_RULES}, got {rule!r}")
        self.rule, self.owner = rule, owner
        self.eta = _number(owner, "eta", eta)
        if self.eta <= 0:
            raise ValueError(f"{owner}: eta must be > 0, got {eta}")
        self.beta_1 = _number(owner, "beta_1", beta_1)
        self.beta_2 = _number(owner, "beta_2", beta_2)
        for name, b in (("beta_1", self.beta_1), ("beta_2", self.beta_2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{owner}: {name} must lie in [0, 1), got {b}")
        self.tau = _number(owner, "tau", tau)
        if self.tau <= 0:
            raise ValueError(f"{owner}: tau must be > 0 (it keeps m / (sqrt(v) + tau) finite where v = 0), got {tau}")
        if isinstance(bias_correction, bool):
            bias_correction = "flower" if bias_correction else "none"
        if bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(
                f"{owner}: bias_correction must be True, False or one of {BIAS_CORRECTIONS}, got {bias_correction!r}"
            )
        self.bias_correction = bias_correction
        self.initial_v = _number(owner, "initial_v", initial_v)
        if self.initial_v < 0:
            raise ValueError(f"{owner}: initial_v must be >= 0, got {initial_v}")
        self.m: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.t = 0
        self.last_step_size = self.eta

    def step_size(self, t: int, round_index: int) -> float:
        """eta_t of step ``t`` (1-based) in round ``round_index`` (0-based), in float64 as Flower."""
        if self.bias_correction == "none":
            return self.eta
        e = float(round_index + 2) if self.bias_correction == "flower" else float(t)  # Flower: server_round + 1
        return self.eta * math.sqrt(1.0 - self.beta_2**e) / (1.0 - self.beta_1**e)

    def _state(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """m and v for the model x (allocated at the first step; a loaded state is moved to x's device once)."""
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        if self.m is None or self.v is None:
            self.m = torch.zeros(x.numel(), dtype=dt, device=x.device)
            self.v = torch.full((x.numel(),), self.initial_v, dtype=dt, device=x.device)
        for name in ("m", "v"):
            s = getattr(self, name)
            if s.dim() != 1 or s.numel() != x.numel():
                raise ValueError(
                    f"{self.owner}: optimiser state {name} has shape {tuple(s.shape)}, expected "
                    f"[{x.numel()}] (the model's d): a state_dict of another model?"
                )
            if s.device != x.device or s.dtype != dt:
                setattr(self, name, s.to(device=x.device, dtype=dt))
        assert self.m is not None and self.v is not None
        return self.m, self.v

    def step_(
        self, x: torch.Tensor, io: torch.Tensor, round_index: int, from_model: bool = False, scale: float = 1.0
    ) -> torch.Tensor:
        """One step (see the class docstring) with step size ``scale * eta_t``; returns ``io``, now the
        new model."""
        m, v = self._state(x)
        t = self.t + 1
        lr = scale * self.step_size(t, round_index)
        ops.server_opt_step_(
            io,
            m,
            v,
            x,
            rule=self.rule,
            lr=lr,
            beta_1=self.beta_1,
            beta_2=self.beta_2 if self.rule != "adagrad" else 0.0,
            tau=self.tau,
            from_model=from_model,
        )
        self.t = t
        self.last_step_size = lr
        return io

    def info(self) -> Dict[str, Any]:
        return {"eta_t": self.last_step_size, "t": self.t}


def opt_attr(name: str) -> property:
    """A method's declared-state attribute ``name`` (m, v, t) read from and written to its ``opt``."""

    def get(self: Any) -> Any:
        return getattr(self.opt, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self.opt, name, int(value) if name == "t" else value)

    return property(get, set_, doc=f"the server optimiser's {name} (state_dict / load_state_dict)")


class _FedOpt(FedAvg):
    """FedAvg's sample-weighted mean update as the pseudo-gradient, then one adaptive optimiser step
    (the shared body of FedAdam / FedYogi / FedAdagrad; Flower's FedOpt)."""

    rule = "adam"
    state_attrs = ("m", "v", "t")
    m = opt_attr("m")
    v = opt_attr("v")
    t = opt_attr("t")

    def _setup_opt(
        self,
        eta: float,
        eta_l: float,
        beta_1: float,
        beta_2: float,
        tau: float,
        bias_correction: Union[bool, str],
        initial_v: float,
    ) -> None:
        self.eta_l = _number(self.name, "eta_l", eta_l)
        if self.eta_l <= 0:
            raise ValueError(f"{self.name}: eta_l must be > 0, got {eta_l}")
        self.opt = ServerOptimizer(self.rule, eta, beta_1, beta_2, tau, bias_correction, initial_v, owner=self.name)

    # (the simulator's range checks before a run; the constructor checks them too)
    option_ranges = {
        "eta": "> 0",
        "eta_l": "> 0",
        "beta_1": "[0, 1)",
        "beta_2": "[0, 1)",
        "tau": "> 0",
        "initial_v": ">= 0",
    }

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum",)  # the screened weighted_sum over U; the step is a pass over d only

    def _aggregate(self, rin: RoundInput) -> AggResult:
        p = self.weights(rin)
        delta = rin.weighted_sum(p)  # (screens the rows in the same pass) [d], fresh
        new = self.opt.step_(rin.global_flat, delta, self.round, scale=self.server_lr)
        return AggResult(new, {"weights": info_values(p), **self.opt.info()})


@register("fedadam")
class FedAdam(_FedOpt):
    """FedAdam (Reddi et al. 2021; Flower's FedAdam): Adam on the server over the weighted mean update.

    Options (Flower's names and defaults): ``eta`` = 0.1 (server step), ``eta_l`` = 0.1 (client
    learning rate: recorded, not used, as in Flower), ``beta_1`` = 0.9, ``beta_2`` = 0.99, ``tau`` = 1e-9,
    ``bias_correction`` = True (Flower's eta sqrt(1 - beta_2^(r+1)) / (1 - beta_1^(r+1)), r the 1-based
    round; "adam": with the step count; False: none, the paper's Algorithm 2), ``initial_v`` = 0.0,
    ``weighting`` ("samples", as Flower, or "uniform"). State: m, v ([d] float32, float64 for a float64
    model), t. One screened weighted_sum pass over U, then one fused pass over d (ops.server_opt_step_).
    """

    rule = "adam"

    def __init__(
        self,
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-9,
        bias_correction: Union[bool, str] = True,
        initial_v: float = 0.0,
        **kw: Any,
    ):
        super().__init__(**kw)
        self._setup_opt(eta, eta_l, beta_1, beta_2, tau, bias_correction, initial_v)


@register("fedyogi")
class FedYogi(_FedOpt):
    """FedYogi (Reddi et al. 2021; Flower's FedYogi): Yogi's additive second moment on the server.

    Options (Flower's names and defaults): ``eta`` = 1e-2, ``eta_l`` = 0.0316 (recorded, not used),
    ``beta_1`` = 0.9, ``beta_2`` = 0.99, ``tau`` = 1e-3, ``bias_correction`` = False (as Flower's
    FedYogi; True / "adam" as FedAdam), ``initial_v`` = 0.0, ``weighting``. State: m, v, t.
    """

    rule = "yogi"

    def __init__(
        self,
        eta: float = 1e-2,
        eta_l: float = 0.0316,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        bias_correction: Union[bool, str] = False,
        initial_v: float = 0.0,
        **kw: Any,
    ):
        super().__init__(**kw)
        self._setup_opt(eta, eta_l, beta_1, beta_2, tau, bias_correction, initial_v)


@register("fedadagrad")
class FedAdagrad(_FedOpt):
    """FedAdagrad (Reddi et al. 2021; Flower's FedAdagrad): v accumulates the squared mean updates.

    Options (Flower's names and defaults): ``eta`` = 0.1, ``eta_l`` = 0.1 (recorded, not used),
    ``tau`` = 1e-9, ``beta_1`` = 0.0 (Flower fixes it at 0; the paper's momentum: 0.9), ``initial_v`` =
    0.0, ``weighting``. No bias correction (none in Flower; there is no beta_2). State: m, v, t.
    """

    rule = "adagrad"

    def __init__(
        self,
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        tau: float = 1e-9,
        beta_1: float = 0.0,
        initial_v: float = 0.0,
        **kw: Any,
    ):
        super().__init__(**kw)
        self._setup_opt(eta, eta_l, beta_1, 0.0, tau, False, initial_v)


# ---- the optimiser around any method (the wrapper seam) -------------------------------------------------
_RULE_METHOD = {"adam": FedAdam, "yogi": FedYogi, "adagrad": FedAdagrad}
_PART_OPTIONS = ("eta", "beta_1", "beta_2", "tau", "bias_correction", "initial_v")


def server_opt_options(spec: Any, owner: str) -> Dict[str, Any]:
    """The ServerOptimizer arguments of a ``server_opt`` value: a rule name ("adam", "yogi", "adagrad";
    the ``fed``-prefixed method names too) with Flower's defaults for that strategy (the defaults of
    fedadam / fedyogi / fedadagrad), or a mapping ``{"rule": ..., "eta": ..., ...}`` overriding them.
    ValueError (one line) for an unknown rule or key."""
    given: Dict[str, Any] = {}
    if isinstance(spec, str):
        rule = spec
    elif isinstance(spec, dict) or hasattr(spec, "items"):
        given = dict(spec.items())
        rule = given.pop("rule", None)
    else:
        raise ValueError(
            f"{owner}: server_opt={spec!r}: expected a rule name ('adam', 'yogi', 'adagrad') or a "
            "mapping {'rule': ..., 'eta': ..., ...}"
        )
    rule = rule[3:] if isinstance(rule, str) and rule.startswith("fed") else rule
    if rule not in _RULE_METHOD:
        raise ValueError(f"{owner}: server_opt rule {rule!r}: expected one of {tuple(_RULE_METHOD)}")
    params = signature_params(_RULE_METHOD[rule])
    allowed = [k for k in _PART_OPTIONS if k in params]
    for key in given:
        if key not in allowed:
            raise ValueError(f"{owner}: server_opt option {key!r} is not one of {allowed} (rule {rule!r})")
    opts = {k: params[k][1] for k in allowed}
    opts.update(given)
    opts.setdefault("beta_2", 0.0)
    opts.setdefault("bias_correction", False)
    return {"rule": rule, **opts}


@register_wrapper
class ServerOpt(MethodWrapper):
    """An adaptive server optimiser after any method's update (``server_opt=``): the method's new model
    ``new`` gives the pseudo-gradient ``new - x``, and one ``ServerOptimizer`` step (FedAdam / FedYogi /
    FedAdagrad's, Flower's defaults per rule unless given) makes the round's model, in one fused pass
    over d (``ops.server_opt_step_`` with ``from_model``) on a copy of ``new``. E.g. a trimmed mean followed by
    an Adam step: ``build("trimmed_mean", beta=0.1, server_opt="adam")``. The round's screen and bad-row
    policy are the method's (the step runs after them). State: m, v, t (``state_dict`` beside the
    method's, under ``"inner"``). ``info["server_opt"]``: the rule, eta_t and t."""

    option = "server_opt"
    annotation = Optional[Union[str, Dict[str, Any]]]
    default = None
    state_attrs = ("m", "v", "t")
    m = opt_attr("m")
    v = opt_attr("v")
    t = opt_attr("t")

    def __init__(self, inner: Aggregator, server_opt: Union[str, Dict[str, Any]]) -> None:
        super().__init__(inner)
        o = server_opt_options(server_opt, self.name)
        self.server_opt = server_opt
        self.opt = ServerOptimizer(owner=f"{self.name} (server_opt)", **o)

    def after(self, rin: RoundInput, res: AggResult) -> AggResult:
        # a copy of the method's model: its result may be a buffer the method keeps (only our copy is written)
        new = self.opt.step_(rin.global_flat, res.params.clone(), self.round, from_model=True)
        res.info["server_opt"] = {"rule": self.opt.rule, **self.opt.info()}
        return AggResult(new, res.info)
