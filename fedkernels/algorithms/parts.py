"""Algorithm parts shared by several methods, written once (the role of Flower's ``aggregate.py``).

* :func:`client_weights` - how a round's clients are weighted: ``"samples"`` p_k = n_k / sum n, or
  ``"uniform"`` 1/K (the papers' 1/|S|).
* :class:`ServerMomentum` - v <- beta v + sum_k p_k U_k (FedAvgM; FedAWARE's ``fedavgm`` extension);
  :func:`momentum_attr` - its v as a method's declared-state attribute.
* :func:`controlled_entries` / :func:`check_n_ctrl` - a masked set of parameters (FedPGVC's and
  FedPVR's last layers; every parameter for SCAFFOLD); :func:`split_layers` - GC-Fed's local /
  global split of the parameter tensors.
* :func:`momentum_steps` / :func:`optimizer_lr_momentum` - the effective number of local steps of SGD
  with momentum (FedNova's ||a||_1; SCAFFOLD's ``momentum_correction``) and the optimizer's lr, momentum.
* :func:`check_choice` - the one-line error for an option outside its allowed values.

The control variates over a masked range (SCAFFOLD, FedPVR) are ``control_variates.py``.

Declared state (``Aggregator.state_attrs``) lives in ``base.py``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .base import RoundInput

WEIGHTINGS = ("samples", "uniform")


def check_choice(method: str, option: str, value, allowed: Sequence) -> None:
    """ValueError naming the method, the option, the value and the allowed values."""
    if value not in allowed:
        raise ValueError(f"{method}: {option} must be one of {tuple(allowed)}, got {value!r}")


# ---- client weighting --------------------------------------------------------------------------
def client_weights(rin: RoundInput, weighting: str) -> torch.Tensor:
    """[K] float64 host weights of the round's clients: n_k / sum n ("samples") or 1/K ("uniform")."""
    if weighting == "uniform":
        return rin.num_examples.new_full((rin.K,), 1.0 / rin.K)
    if weighting == "samples":
        return rin.sample_weights()
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


# ---- server momentum ---------------------------------------------------------------------------
class ServerMomentum:
    """Heavy-ball momentum on the server: ``v <- beta v + sum_k p_k U_k`` in one ``weighted_sum``
    pass that accumulates straight into v. v ([d], dtype and device of the global model) is
    allocated at the first round; ``v`` is the state to save."""

    def __init__(self, beta: float):
        self.beta = float(beta)
        self.v: Optional[torch.Tensor] = None

    def step(self, rin: RoundInput, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The same update through ``rin.weighted_sum`` (the pass that screens U's rows in
        ``Aggregator.screen_in_pass`` methods): v is replaced only after that pass, so a round the
        screen restarts has changed nothing."""
        if self.v is None or self.v.shape != like.shape:
            self.v = torch.zeros_like(like)
        v = self.v.to(device=like.device, dtype=like.dtype)
        self.v = rin.weighted_sum(p, base=v.mul(self.beta))
        return self.v


def momentum_attr(holder: str) -> property:
    """The declared-state attribute of a method's :class:`ServerMomentum`: reads and writes the v of
    the ServerMomentum held in attribute ``holder`` (FedAvgM's ``momentum``, FedAWARE's ``ext_momentum``)."""

    def get(self) -> Optional[torch.Tensor]:
        return getattr(self, holder).v

    def set_(self, v: Optional[torch.Tensor]) -> None:
        getattr(self, holder).v = v

    return property(get, set_, doc=f"the server momentum v of {holder} (None before the first round)")


# ---- masked parameter ranges -------------------------------------------------------------------
def controlled_entries(spec, n_ctrl: Union[int, str] = 2, modules: Optional[Sequence[str]] = None):
    """The FlatSpec entries (parameters only, no buffers) of a controlled set (FedPGVC's S_gvc,
    FedPVR's variance-reduced layers).

    ``modules``: explicit module names (exact names, e.g. ``["fc2", "fc3"]``); otherwise the last
    ``n_ctrl`` parameterised non-norm modules counted from the output. Norm modules between the
    first selected module and the output join the set; ones before it stay out. ``n_ctrl="all"``
    selects every parameter (SCAFFOLD)."""
    params = [e for e in spec.entries if not e.is_buffer]
    if isinstance(n_ctrl, str):
        if n_ctrl != "all":
            raise ValueError(f"n_ctrl must be a non-negative int or 'all', got {n_ctrl!r}")
        return params
    order = spec.layer_modules()
    if modules is not None:
        known = set(order)
        unknown = [m for m in modules if m not in known]
        if unknown:
            raise ValueError(f"controlled modules {unknown} are not parameterised modules of the model; known: {order}")
        sel = set(modules)
        return [e for e in params if e.module in sel]
    if not isinstance(n_ctrl, int) or isinstance(n_ctrl, bool) or n_ctrl < 0:
        raise ValueError(f"n_ctrl must be a non-negative int or 'all', got {n_ctrl!r}")
    if n_ctrl == 0:
        return []
    norm_mods = {e.module for e in params if e.kind == "norm"}
    layers = [m for m in order if m not in norm_mods]
    if n_ctrl > len(layers):
        raise ValueError(f"n_ctrl={n_ctrl} but the model has only {len(layers)} parameterised (non-norm) layers")
    first = order.index(layers[-n_ctrl])
    sel = set(order[first:])
    return [e for e in params if e.module in sel]


def _prefix_match(name: str, prefixes: Sequence[str]) -> bool:
    for p in prefixes:
        q = p if p.endswith(".") else p + "."
        if name == p or name.startswith(q):
            return True
    return False


def split_layers(
    names: Sequence[str],
    local_layers: str = "all_except",
    global_layers: Optional[Sequence[str]] = None,
    lam: Optional[float] = None,
) -> List[bool]:
    """Per parameter tensor (``names`` in named_parameters order): True = in the local (Local GC) set.

    local_layers: "all_except" (every tensor except those under the module prefixes
    ``global_layers``, matched as exact module prefixes: "fc" does not match "fc1.weight"),
    "first_fraction" (the first floor(lam * L + 1e-9) tensors), "all", "none"."""
    L = len(names)
    if local_layers == "all":
        return [True] * L
    if local_layers == "none":
        return [False] * L
    if local_layers == "first_fraction":
        if lam is None or not 0.0 <= lam <= 1.0:
            raise ValueError(f"split_layers: lam must lie in [0, 1] for 'first_fraction', got {lam!r}")
        n = int(math.floor(lam * L + 1e-9))
        return [i < n for i in range(L)]
    if local_layers == "all_except":
        if not global_layers:
            raise ValueError("split_layers: 'all_except' needs global_layers (module prefixes)")
        hit = [_prefix_match(n, global_layers) for n in names]
        for p in global_layers:
            if not any(_prefix_match(n, [p]) for n in names):
                raise ValueError(f"split_layers: global layer prefix {p!r} matches no parameter; names: {list(names)}")
        return [not h for h in hit]
    raise ValueError(f"split_layers: local_layers must be all_except|first_fraction|all|none, got {local_layers!r}")


def check_n_ctrl(method: str, n_ctrl) -> None:
    if not (isinstance(n_ctrl, str) and n_ctrl == "all") and not (
        isinstance(n_ctrl, int) and not isinstance(n_ctrl, bool) and n_ctrl >= 0
    ):
        raise ValueError(f"{method}: n_ctrl must be a non-negative int or 'all', got {n_ctrl!r}")


# ---- local steps of SGD with momentum ---------------------------------------------------------
def momentum_steps(tau: float, rho: float = 0.0) -> float:
    """||a||_1 for tau steps of SGD with momentum rho (buf = rho buf + g; w -= lr buf)."""
    tau, rho = float(tau), float(rho)
    if not (0.0 <= rho < 1.0):
        raise ValueError(f"momentum must lie in [0, 1), got {rho}")
    if rho == 0.0:
        return tau
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


def optimizer_lr_momentum(optimizer) -> Tuple[Optional[float], float]:
    """(lr, momentum) of the optimizer's first parameter group ((None, 0) when it has none)."""
    try:
        g = optimizer.param_groups[0]
    except (AttributeError, IndexError, TypeError):
        return None, 0.0
    lr = g.get("lr")
    return (None if lr is None else float(lr)), float(g.get("momentum", 0.0) or 0.0)
