"""Client-level differential privacy around any method whose update is one weighted sum of the clients'
updates: ``build(name, dp={...})``, ``wrap(agg, dp={...})``; from the CLI the ``dp.*`` config section.

The mechanism is DP-FedAvg (McMahan et al., 2018, "Learning Differentially Private Recurrent Language
Models") with the semantics of Flower's DP wrappers (``DifferentialPrivacyServerSideFixedClipping``,
``...ClientSideFixedClipping``, ``...ServerSideAdaptiveClipping``):

* ``kind="central"``: the server clips each update to norm C, ``U_k * min(1, C / ||U_k||)`` (the norms from
  one screening pass, ``RoundInput.kstats``; the rows are then read as ``diag(s) U``, no copy), the inner
  method aggregates them, and Gaussian noise is added to the aggregate. With the fair weights this forces
  (every client's ``num_examples`` is set to 1: a sample-count weight is not a bounded contribution) the
  inner method's sum is ``alpha * sum_k c_k s_k U_k`` with ``c_k = 1/m``; its noise has std
  ``z * C * max_k |alpha c_k|`` = ``alpha z C / m`` (Flower's ``compute_stdv``: z C / m on the average), drawn
  by the counter-based generator in the sum's own output write (``ops.weighted_sum_noised``, seed
  ``seed``, counter ``2 * round``): the noise sits in the aggregate, before any server state (momentum,
  server optimisers) sees it, so everything after it is post-processing.
* ``kind="client"``: the clients clip their own update to C (the simulator clips each row as it is
  written); the server adds the same noise and reads U once.
* ``kind="adaptive"``: Andrew et al., 2021, "Differentially Private Learning with Adaptive Clipping": the
  clip norm C_t follows the ``target_clipped_quantile`` (gamma) of the update norms; each round
  ``C <- C exp(-clip_norm_lr (b - gamma))`` with ``b`` the noised fraction of updates with norm <= C
  (count noise std ``clipped_count_stddev``, default m / 20 as Flower), and the model noise multiplier
  ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` so that the pair is one Gaussian mechanism of multiplier
  z (Andrew et al. Thm 1; Flower's ``compute_adaptive_noise_params``). Two deliberate differences from
  Flower's code: the bit counts updates *within* the norm (the paper's b; Flower counts clipped ones,
  which reverses the step), and the round's noise uses the clip norm that clipped it (Flower noises
  with the already-updated norm).

The privacy accounting (``fedkernels.privacy``, dp-accounting's RDP): each round is a subsampled
Gaussian mechanism of multiplier z on m of N clients; ``info["epsilon"]`` after every round (N from
``setup(num_clients=)`` or ``population=``, m from ``num_sampled_clients=`` or the first round's K).

Methods: the wrapper accepts a method only when its verdict is ``private`` (the method's own
``Aggregator.dp_verdict``; :func:`verdicts` lists them): its
server update reads U through exactly one weighted sum with coefficients that do not depend on the
updates. Methods whose state or payloads carry un-noised client data are refused with the reason;
:class:`Noised` enforces the protocol at run time (a second read of U, or a read through
gram/kstats/blocks, is an error naming the method).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import torch

from .. import ops
from ..ops._checks import has_kernel
from .base import AggResult, Aggregator, RoundInput, RowScaled
from .wrappers import MethodWrapper, clip_scales, register_wrapper

DP_KINDS = ("central", "client", "adaptive")

_DEFAULTS: Dict[str, Any] = {
    "kind": "central",
    "clip": None,
    "noise_multiplier": None,
    "delta": 1e-5,
    "target_epsilon": None,
    "rounds": None,
    "seed": 0,
    "num_sampled_clients": None,
    "population": None,
    "accountant": "rdp",
    "target_clipped_quantile": 0.5,
    "clip_norm_lr": 0.2,
    "clipped_count_stddev": None,
}


def method_verdict(agg: Aggregator) -> Tuple[str, str]:
    """``(name, verdict)`` of the method at the core of ``agg`` (inside any wrappers): its own declaration,
    ``Aggregator.dp_verdict``."""
    core = agg
    while isinstance(core, MethodWrapper):
        core = core.inner
    return core.name, core.dp_verdict


def verdicts() -> Dict[str, str]:
    """``{name: verdict}`` of every registered method (aliases included): "private" or why it is refused."""
    from .base import _REGISTRY

    return {n: cls.dp_verdict for n, cls in _REGISTRY.items()}


def __getattr__(name: str) -> Any:
    # VERDICTS: verdicts(), read from the methods' declarations when asked
    if name == "VERDICTS":
        return verdicts()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_dp_options(opts: Mapping[str, Any], where: str = "dp") -> Dict[str, Any]:
    """The DP options with defaults filled, or ValueError (one line) naming the key, value and expectation."""
    if not isinstance(opts, Mapping):
        raise ValueError(f"{where}: expected a mapping of DP options, got {type(opts).__name__}")
    unknown = [k for k in opts if k not in _DEFAULTS]
    if unknown:
        raise ValueError(f"{where}: unknown option {unknown[0]!r}; known: {', '.join(_DEFAULTS)}")
    o = {**_DEFAULTS, **opts}

    def num(key: str, ok: Any, what: str, allow_none: bool = True) -> None:
        v = o[key]
        if v is None and allow_none:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(float(v)):
            raise ValueError(f"{where}.{key}={v!r}: expected {what}")
        o[key] = float(v)

    if o["kind"] not in DP_KINDS:
        raise ValueError(f"{where}.kind={o['kind']!r}: expected one of {', '.join(DP_KINDS)}")
    if o["clip"] is None:
        raise ValueError(f"{where}.clip: required (the L2 norm C each update is clipped to; adaptive: the initial C)")
    num("clip", lambda v: v > 0, "a number > 0 (the clip norm C)")
    num("noise_multiplier", lambda v: v >= 0, "a number >= 0 (the noise std over C)")
    num("delta", lambda v: 0 < v < 1, "a number in (0, 1)", allow_none=False)
    num("target_epsilon", lambda v: v > 0, "a number > 0")
    num("target_clipped_quantile", lambda v: 0 <= v <= 1, "a number in [0, 1]", allow_none=False)
    num("clip_norm_lr", lambda v: v > 0, "a number > 0", allow_none=False)
    num("clipped_count_stddev", lambda v: v >= 0, "a number >= 0")
    if (o["noise_multiplier"] is None) == (o["target_epsilon"] is None):
        raise ValueError(
            f"{where}: give exactly one of noise_multiplier and target_epsilon "
            f"(got noise_multiplier={o['noise_multiplier']!r}, target_epsilon={o['target_epsilon']!r})"
        )
    for key in ("rounds", "num_sampled_clients", "population"):
        v = o[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{where}.{key}={v!r}: expected an integer >= 1")
    if isinstance(o["seed"], bool) or not isinstance(o["seed"], int) or not 0 <= o["seed"] < 2**62:
        raise ValueError(f"{where}.seed={o['seed']!r}: expected an integer in [0, 2^62)")
    if o["accountant"] not in ("rdp",):
        raise ValueError(
            f"{where}.accountant={o['accountant']!r}: expected 'rdp' (the sampling is fixed-size "
            "without replacement, which dp-accounting's PLD accountant does not support)"
        )
    if o["target_epsilon"] is not None:
        missing = [k for k in ("rounds", "num_sampled_clients", "population") if o[k] is None]
        if missing:
            raise ValueError(
                f"{where}.target_epsilon needs {', '.join(missing)} (the planned rounds, clients per "
                "round and clients in all) to calibrate the noise"
            )
        from ..privacy import calibrate_noise_multiplier

        o["noise_multiplier"] = calibrate_noise_multiplier(
            o["target_epsilon"], o["delta"], o["rounds"], o["num_sampled_clients"], o["population"]
        )
    if (
        o["num_sampled_clients"] is not None
        and o["population"] is not None
        and o["num_sampled_clients"] > o["population"]
    ):
        raise ValueError(f"{where}.num_sampled_clients={o['num_sampled_clients']} exceeds population={o['population']}")
    return o


def adaptive_noise(z: float, count_std: float) -> float:
    """The model noise multiplier z_delta of adaptive clipping, ``(z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et
    al., 2021, Thm 1; Flower's ``compute_adaptive_noise_params``): ValueError when sigma_b is too small."""
    if z == 0:
        return 0.0
    if z >= 2 * count_std:
        raise ValueError(
            f"dp.clipped_count_stddev={count_std:g} is too small for noise_multiplier={z:g}: the count "
            f"noise alone exceeds the budget (need clipped_count_stddev > noise_multiplier / 2)"
        )
    return (z**-2 - (2 * count_std) ** -2) ** -0.5


class Noised(RowScaled):
    """The inner method's round input under DP: ``diag(s) U`` (s = the clip factors; ones for client-side
    clipping) read through exactly one ``weighted_sum``, whose result carries Gaussian noise of std
    ``unit * max_k |alpha coef_k|`` (``unit`` = z C). Fused into the sum's output write
    (``ops.weighted_sum_noised``) when U is a screened tensor; otherwise the sum then
    ``ops.add_gaussian_noise_`` on it (a source, or a sum that screens the rows). Any other read of U
    (gram, kstats, blocks, U, a second sum) is refused: its result would not be noised."""

    def __init__(self, base: RoundInput, s: Any, unit: float, seed: int, counter: int, method: str) -> None:
        super().__init__(base, s)
        for k, v in (
            ("unit", unit),
            ("seed", seed),
            ("counter", counter),
            ("method", method),
            ("sums", 0),
            ("sigma", 0.0),
        ):
            object.__setattr__(self, k, v)

    def _refuse(self, what: str) -> None:
        raise ValueError(
            f"dp: {self.method} reads the updates through {what}, whose result is not noised: "
            "this method cannot run under differential privacy"
        )

    def weighted_sum(
        self, coef: Any, base: Optional[torch.Tensor] = None, alpha: float = 1.0, hold: bool = False
    ) -> torch.Tensor:
        if self.sums:
            self._refuse("a second weighted sum in one round")
        object.__setattr__(self, "sums", 1)
        c = torch.as_tensor(coef, dtype=torch.float64).reshape(-1).cpu()
        sigma = self.unit * float((c * float(alpha)).abs().max()) if c.numel() else 0.0
        object.__setattr__(self, "sigma", sigma)
        cs = c * self._s("cpu")
        b = self.base
        if (
            b.src is None
            and not b.unscreened
            and not hold
            and isinstance(b.updates, torch.Tensor)
            and has_kernel("weighted_sum_noised", b.updates.device)
        ):
            return ops.weighted_sum_noised(
                b.updates, cs, base, alpha, sigma=sigma, seed=self.seed, counter=self.counter
            )
        out = b.weighted_sum(cs, base=base, alpha=alpha, hold=hold)
        return ops.add_gaussian_noise_(out, sigma, self.seed, self.counter)

    def gram(self, host: bool = False) -> torch.Tensor:
        self._refuse("gram()")
        raise AssertionError

    def kstats(self, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._refuse("kstats()")
        raise AssertionError

    def blocks(self, device: Optional[torch.device] = None) -> Iterator[Tuple[slice, torch.Tensor]]:
        self._refuse("blocks()")
        raise AssertionError

    @property
    def U(self) -> torch.Tensor:
        self._refuse("the U tensor")
        raise AssertionError


@register_wrapper
class DifferentialPrivacy(MethodWrapper):
    """Client-level DP (DP-FedAvg; central, client-side or adaptive clipping, Gaussian noise in the
    aggregate, epsilon from dp-accounting) around a method whose update is one weighted sum."""

    option = "dp"
    annotation = Optional[Mapping[str, Any]]
    screen_in_pass = True
    state_attrs = ("clip", "_acc_rounds")
    reads_beyond_weighted_sum = "each update's norm (ops.kstats) to clip it, and its noised sum of the dense rows"

    def __init__(self, inner: Aggregator, dp: Mapping[str, Any]) -> None:
        super().__init__(inner)
        name, verdict = method_verdict(inner)
        if verdict != "private":
            raise ValueError(f"dp: method {name!r} is refused: {verdict}")
        o = check_dp_options(dp)
        self.options = o
        self.dp = {k: v for k, v in o.items() if v is not None}  # the options as given, filled (repr, logs)
        self.kind = o["kind"]
        self.clip = o["clip"]
        self.noise_multiplier = o["noise_multiplier"]
        self.delta, self.seed = o["delta"], o["seed"]
        self.target_quantile, self.clip_lr = o["target_clipped_quantile"], o["clip_norm_lr"]
        self._acc_rounds = 0
        self._accountant: Any = None
        # {client id: ||U_k||} measured by the simulator as it wrote the rows (server-side code on the same
        # rows): the norms' pass is then skipped. Used for one round, then cleared.
        self.known_norms: Optional[Dict[int, float]] = None
        self._z_model = self.noise_multiplier
        if self.kind == "adaptive":
            m = o["num_sampled_clients"]
            std = o["clipped_count_stddev"]
            if std is None:
                std = (m / 20 if m else None) if self.noise_multiplier > 0 else 0.0
            self.count_std = std
            if std is not None:
                self._z_model = adaptive_noise(self.noise_multiplier, std)

    def setup(
        self, spec: Any = None, num_clients: Optional[int] = None, global_flat: Optional[torch.Tensor] = None
    ) -> None:
        # Buffers (BatchNorm running statistics) are the participants' plain average in every round
        # (algorithms/buffers.py): neither clipped nor noised, they would release client data outside the
        # guarantee. Refused, as Opacus refuses BatchNorm: GroupNorm / LayerNorm have no buffers.
        bufs = [e.name for e in getattr(spec, "entries", ()) if e.is_buffer and e.numel > 0]
        if bufs:
            raise ValueError(
                f"dp: the model has buffers ({', '.join(bufs[:3])}{', ...' if len(bufs) > 3 else ''}), "
                "which every method averages without clipping or noise; use a model without "
                "running statistics (GroupNorm or LayerNorm instead of BatchNorm)"
            )
        super().setup(spec, num_clients, global_flat)

    # ---- the round ----------------------------------------------------------------------------------
    def _sample_size(self, K: int) -> int:
        return self.options["num_sampled_clients"] or K

    def before(self, rin: RoundInput) -> RoundInput:
        K = rin.K
        m = self._sample_size(K)
        if self.kind == "adaptive" and self.count_std is None:  # Flower's default: m / 20
            self.count_std = m / 20 if self.noise_multiplier > 0 else 0.0
            self._z_model = adaptive_noise(self.noise_multiplier, self.count_std)
        rin.num_examples = torch.ones(K, dtype=torch.float64)  # fair weights: a bounded contribution each
        C = self.clip
        if self.kind == "client":
            s = torch.ones(K, dtype=torch.float64)
            self._within = None
        else:
            known = self.known_norms
            if known is not None and all(c in known for c in rin.client_ids):
                norms = torch.tensor([known[c] for c in rin.client_ids], dtype=torch.float64)
                s = torch.where(norms > C, C / norms, torch.ones_like(norms))  # (the sum screens the rows)
            else:
                s, norms = clip_scales(rin, C)  # the screening pass (kstats' nsq)
            self._within = int((norms <= C).sum())
        self._clipped = int((s < 1).sum())
        self._round_clip = C
        return Noised(rin, s, self._z_model * C, self.seed, 2 * self.round, self.name)

    def after(self, rin: RoundInput, res: AggResult) -> AggResult:
        self.known_norms = None
        info = res.info
        info["dp_clip"] = self._round_clip
        info["dp_clipped"] = self._clipped
        info["dp_noise_multiplier"] = self.noise_multiplier
        if self.kind == "adaptive":
            m = self._sample_size(rin.K)
            z_b = float(ops.philox_normal(1, self.seed, 2 * self.round + 1)[0])  # the count's noise
            frac = (self._within + self.count_std * z_b) / m
            self.clip = self.clip * math.exp(-self.clip_lr * (frac - self.target_quantile))
            info["dp_next_clip"] = self.clip
        info["epsilon"] = self._step_accountant(rin.K)
        return res

    def _step_accountant(self, K: int) -> Optional[float]:
        N = self.options["population"] or self.num_clients
        self._acc_rounds += 1
        if not N:
            return None
        if self._accountant is None:
            from ..privacy import PrivacyAccountant

            self._accountant = PrivacyAccountant(
                self.noise_multiplier, min(self._sample_size(K), N), int(N), self.delta
            )
        return self._accountant.epsilon_at(self._acc_rounds)

    def epsilon(self) -> Optional[float]:
        """Epsilon after the rounds aggregated so far (None without the population size)."""
        if self._accountant is None:
            return 0.0 if self._acc_rounds == 0 else None
        return self._accountant.epsilon_at(self._acc_rounds)

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        own = super().passes(K)
        return own if self.kind == "client" else ("sum",) + own
