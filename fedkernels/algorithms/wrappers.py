"""Wrappers: what acts around any method's update, built once and composed with every method.

A :class:`MethodWrapper` is an ``Aggregator`` around another (the *inner* method, itself possibly a
wrapper). The round runner (:mod:`fedkernels.algorithms.runner`: validation, the NaN/Inf screen, the
bad-row policy) runs once, on the wrapper, which answers its questions with the inner method's
checks; the wrapper's update is the inner method's between two narrow hooks::

    rin = wrapper.before(rin)          # e.g. scale the rows: rin.with_row_scale(s), no K x d copy
    res = inner._aggregate(rin)        # the method's update
    res = wrapper.after(rin, res)      # e.g. change the new global model or the info dict

Everything else is the inner method's: its options (read through the wrapper by attribute), client
side, payloads and their checks, passes, round counter, state (``state_dict`` nests it under
``"inner"`` beside the wrapper's own). A wrapper is reached by an option of :func:`build`
(``algorithms.build("fedavg", norm_bound=5.0)``; from the CLI ``algorithm.options.norm_bound=5``) or
by :func:`wrap` around an aggregator already built.

:class:`NormBound` (``norm_bound=M``): Sun et al., 2019, "Can You Really Backdoor Federated
Learning?": every update is clipped to norm at most M, ``U_k * min(1, M / ||U_k||)``, before the method
sees it (the rule of Flower's fixed clipping, ``clip_inputs_inplace``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Type

import torch

from ..sources import round_passes
from .base import AggResult, Aggregator, ClientRule, RoundInput, _copy_state
from .signature import Option, describe, expected, fmt_value, matches, normalize_value, suggest

# build / wrap keyword -> the wrapper that takes it, in the order wrap applies them (the first innermost)
WRAPPERS: Dict[str, Type["MethodWrapper"]] = {}


def register_wrapper(cls: Type["MethodWrapper"]) -> Type["MethodWrapper"]:
    """Class decorator: the wrapper's ``option`` becomes a keyword of ``build`` and ``wrap``."""
    if cls.option in WRAPPERS and WRAPPERS[cls.option] is not cls:
        raise ValueError(f"wrapper option {cls.option!r} registered twice")
    WRAPPERS[cls.option] = cls
    return cls


def _delegated(attr: str, doc: str) -> property:
    return property(lambda self: getattr(self.inner, attr), lambda self, v: setattr(self.inner, attr, v), doc=doc)


class MethodWrapper(Aggregator):
    """An aggregator around ``inner`` (any built method or wrapper): the inner method's round with
    :meth:`before` / :meth:`after` around its update. A subclass sets ``option`` (its keyword),
    ``annotation`` and ``default`` (for the option checks of ``build`` and the simulator) and
    overrides the hooks; its state beyond the inner method's goes in ``state_attrs``."""

    name = "wrapper"
    option = ""  # the build / wrap keyword (registered wrappers)
    annotation: Any = Optional[float]
    default: Any = None

    def __new__(cls, *args: Any, **options: Any) -> "MethodWrapper":
        return object.__new__(cls)  # (no method options to check: the inner method's were)

    def __init__(self, inner: Aggregator) -> None:
        if not isinstance(inner, Aggregator):
            raise TypeError(f"{type(self).__name__}: inner must be a fedkernels Aggregator, got {type(inner).__name__}")
        self.inner = inner
        self.name = inner.name  # errors and logs name the method

    # the inner method's options and round state, read and written through the wrapper
    on_bad_update = _delegated("on_bad_update", "the inner method's bad-row policy")
    server_lr = _delegated("server_lr", "the inner method's server learning rate")
    round = _delegated("round", "the round counter (the inner method's)")
    num_clients = _delegated("num_clients", "N, set by setup (the inner method's)")
    spec = _delegated("spec", "the model's FlatSpec, set by setup (the inner method's)")
    screen_in_pass = _delegated("screen_in_pass", "whether the update's first read of U screens it")
    no_chunked_source = _delegated("no_chunked_source", "why the inner method refuses a chunked source")
    client_rule_cls = _delegated("client_rule_cls", "the inner method's client rule class")
    screened_payload_keys = _delegated("screened_payload_keys", "the payload tensors the inner method reads")
    reads_beyond_weighted_sum = _delegated(
        "reads_beyond_weighted_sum", "what the update reads of U beyond weighted sums (None: packed rows do)"
    )

    def __getattr__(self, key: str) -> Any:
        # a method's own options and state (agg.mode, agg.momentum, ...): the inner method's
        if key.startswith("__") or key == "inner":
            raise AttributeError(key)
        return getattr(self.inner, key)

    # ---- the seam ---------------------------------------------------------------------------------
    def before(self, rin: RoundInput) -> RoundInput:
        """What the inner method's update gets (default: ``rin``). Reads U only through ``rin``; the
        first read screens the rows when ``screen_in_pass`` (bad rows: the round starts again here)."""
        return rin

    def after(self, rin: RoundInput, res: AggResult) -> AggResult:
        """The round's result from the inner method's (default: as it is); ``rin`` is what
        :meth:`before` was given."""
        return res

    def _aggregate(self, rin: RoundInput) -> AggResult:
        return self.after(rin, self.inner._aggregate(self.before(rin)))

    # ---- the inner method's lifecycle, client side and checks --------------------------------------
    def setup(
        self, spec: Any = None, num_clients: Optional[int] = None, global_flat: Optional[torch.Tensor] = None
    ) -> None:
        self.inner.setup(spec, num_clients, global_flat)

    def client_rule(self) -> Optional[ClientRule]:
        return self.inner.client_rule()

    def local_training_conflict(self, steps: Optional[int]) -> Optional[str]:
        return self.inner.local_training_conflict(steps)

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        return self.inner.client_payload(client_id)

    def prepare_round(self, global_flat: Any) -> None:
        self.inner.prepare_round(global_flat)

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        return self.inner.check_payload(payload)

    def suspect_payloads(self, payloads: Any) -> Optional[Any]:
        return self.inner.suspect_payloads(payloads)

    def check_payloads(self, payloads: Any) -> Dict[int, str]:
        return self.inner.check_payloads(payloads)

    def payload_stack(self, rin: RoundInput, key: str) -> torch.Tensor:
        return self.inner.payload_stack(rin, key)

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        """The inner method's passes (a wrapper that reads U adds its own: override)."""
        return round_passes(self.inner, K)[0]

    # ---- state: the wrapper's own (state_attrs) with the inner method's nested ----------------------
    def state_dict(self) -> Dict[str, Any]:
        st: Dict[str, Any] = {"round": self.round, "num_clients": self.num_clients}
        for k in self.state_attrs:
            st[k] = _copy_state(getattr(self, k))
        st["inner"] = self.inner.state_dict()
        return st

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "inner" not in state:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: no 'inner' entry (the wrapped method's "
                "state): the state is not a wrapper's"
            )
        self.inner.load_state_dict(state["inner"])
        for k in self.state_attrs:
            if k in state:
                setattr(self, k, _copy_state(state[k]))

    def __repr__(self) -> str:
        own = f", {self.option}={getattr(self, self.option)!r}" if self.option else ""
        return f"{type(self).__name__}({self.inner!r}{own})"


def clip_scales(rin: RoundInput, M: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(s, norms)``, [K] float64 on the host: the update norms ``||U_k||`` from one kstats pass over U
    (which screens the rows when they are unscreened) and the clip factors ``s_k = min(1, M / ||U_k||)``
    (1 for a zero row): the clipping of norm_bound and of the DP wrapper (Flower's ``clip_inputs_inplace``)."""
    _, nsq, _ = rin.kstats(rin.sample_weights())
    norms = nsq.sqrt()
    return torch.where(norms > M, M / norms, torch.ones_like(norms)), norms


@register_wrapper
class NormBound(MethodWrapper):
    """Norm bounding (Sun et al., 2019): each client update clipped to norm at most ``norm_bound`` (M),
    ``U_k * min(1, M / ||U_k||)``, before the method sees it. The norms come from one pass over U
    (``RoundInput.kstats``'s ``nsq``) that also screens the rows; the method then reads ``diag(s) U``
    through ``RoundInput.with_row_scale`` (no K x d copy; when no row is over M it reads U itself).
    ``info["norm_clipped"]``: how many updates were clipped this round."""

    option = "norm_bound"
    option_ranges = {"norm_bound": "> 0"}
    screen_in_pass = True  # the norms' kstats pass screens the rows, before any state changes
    reads_beyond_weighted_sum = "each update's norm (ops.kstats) to clip it"

    def __init__(self, inner: Aggregator, norm_bound: float) -> None:
        super().__init__(inner)
        ok = isinstance(norm_bound, (int, float)) and not isinstance(norm_bound, bool)
        if not ok or not (0 < float(norm_bound) < math.inf):
            raise ValueError(
                f"{self.name}: norm_bound={norm_bound!r}: expected a finite number > 0 "
                "(the largest norm an update keeps)"
            )
        self.norm_bound = float(norm_bound)

    def scales(self, rin: RoundInput) -> torch.Tensor:
        """[K] float64 host: ``min(1, M / ||U_k||)`` (1 for a zero row), from one kstats pass."""
        return clip_scales(rin, self.norm_bound)[0]

    def before(self, rin: RoundInput) -> RoundInput:
        s = self.scales(rin)
        self._clipped = int((s < 1).sum())
        return rin.with_row_scale(s) if self._clipped else rin

    def after(self, rin: RoundInput, res: AggResult) -> AggResult:
        res.info["norm_clipped"] = self._clipped
        return res

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        """The norms' pass (it screens, standing for the inner method's own screening read), then the
        inner method's passes."""
        if self.inner.no_chunked_source is not None:
            return ()
        own = round_passes(self.inner, K)[0]
        return ("sum",) + (own if self.inner.screen_in_pass else own[1:])


def wrapper_options() -> Dict[str, Tuple[Any, Any]]:
    """``{option: (annotation, default)}`` of the registered wrappers: the keywords ``build`` and the
    simulator's option checks accept besides a method's own."""
    return {k: (cls.annotation, cls.default) for k, cls in WRAPPERS.items()}


def options() -> Dict[str, Option]:
    """The wrappers' options as ``algorithms.options`` lists them."""
    return {k: Option(describe(expected(a, d)), d, False) for k, (a, d) in wrapper_options().items()}


def split_options(method: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The wrapper keywords of ``options``, removed from it, their types checked (ValueError in
    ``check_options``' words) and number text converted."""
    out = {}
    for key in [k for k in options if k in WRAPPERS]:
        val = options.pop(key)
        exp = expected(WRAPPERS[key].annotation, WRAPPERS[key].default)
        if val is not None and not matches(val, exp):
            raise ValueError(
                f"{method}: option {key}={fmt_value(val)}: expected {describe(exp)}, got {type(val).__name__}"
            )
        out[key] = normalize_value(val, exp)
    return out


def wrap(agg: Aggregator, **options: Any) -> Aggregator:
    """``agg`` inside the wrappers named by ``options`` (``norm_bound=M``), applied in registration
    order (the first innermost); an option set to None adds no wrapper. ValueError for an unknown
    option (one line, with the known ones) or a bad value (the wrapper's own check)."""
    if not isinstance(agg, Aggregator):
        raise TypeError(f"wrap: agg must be a fedkernels Aggregator, got {type(agg).__name__}")
    for key in options:
        if key not in WRAPPERS:
            raise ValueError(f"wrap: unknown option {key!r}; {suggest(key, WRAPPERS)}known: {', '.join(WRAPPERS)}")
    for key, cls in WRAPPERS.items():
        if options.get(key) is not None:
            agg = cls(agg, options[key])
    return agg
