"""The simulator's LoRA fine-tuning (config section ``lora``; the maths in ``fedkernels.lora``, docs/lora.md).

With ``lora.mode`` set the run's model is wrapped with peft (``wrap``: the base model, its pretrained weights from
``lora.base`` when given, LoRA layers of rank ``lora.r`` on ``lora.target_modules``); the base is frozen, so the
flat vector the clients train, send and the server aggregates holds only the trainable tensors: the adapters
(and the float buffers, averaged as in every run). ``LoraRun`` is that run's side:

- the flat space (``spec``: a ``LoraSpec`` over the trainable tensors, its LoRA layers' slices in that vector);
- heterogeneous ranks (``lora.ranks``, cycled over the client ids: client c trains at rank
  ``ranks[c % len(ranks)]``): a client starts from its first r_c components of the global adapters
  (``client_start``) and trains only those, in the server's layout (A's rows and B's columns beyond r_c zero,
  their gradients zeroed). Every client keeps the server's scaling s = alpha / r: a rank-r_c client is a peft
  adapter of rank r_c with ``lora_alpha = alpha * r_c / r`` (rslora: ``alpha * sqrt(r_c / r)``), as HetLoRA
  and FlexLoRA's truncation treat the clients' adapters as slices of the server's (with peft's default of one
  alpha for every rank, a rank-1 client's update would be scaled r times more than a rank-r one's);
- the server's step (``aggregate``): with plain FedAvg the adapters ``global + row`` go to ``LoraAggregator``
  (naive / exact / fold, client ranks; its distances to the true average update in the round's ``agg``
  metrics) through the round runner (``fedkernels.lora.LoraRound``: its validation, NaN/Inf screen and the
  run's ``on_bad_update`` policy, as for every method), fold's residuals are added to the frozen base weights; a codec (``compress.*``) encodes each row
  as its client sends it and the server decodes the rows first (the factors are needed, not only their sum).
  Any other method (``naive`` with equal ranks only) runs its own round on the adapter rows. ``bytes_sent``:
  what the clients sent (each client's adapters at its rank, or the codec's bytes);
- its checkpoint state (fold: the base weights it changed) and its provenance (``describe``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..flat import FlatSpec
from ..lora import MODES, LoraAggregator, LoraRound, LoraSpec

PEFT_HINT = "pip install fedkernels[lora]"
_LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _peft_missing() -> Optional[str]:
    try:
        import peft  # noqa: F401
    except ImportError as e:
        return f"lora.mode needs the peft package ({e}): {PEFT_HINT}"
    return None


def _own_path(cfg: Any) -> bool:
    """Whether the LoRA aggregator runs the round (plain FedAvg: the mode's maths, with its distances to the
    true average) rather than the method (naive with equal ranks and any other method or FedAvg option)."""
    opts = {k for k in cfg.algorithm.options if k not in ("weighting", "on_bad_update")}
    return cfg.algorithm.name == "fedavg" and not opts and cfg.dp.kind is None


def config_errors(cfg: Any) -> List[str]:
    """The section's checks that need no model, as RunConfig.validate's lines."""
    c = cfg.lora
    if c.mode is None:
        changed = [
            k for k, v in (("ranks", c.ranks), ("target_modules", c.target_modules), ("base", c.base)) if v is not None
        ]
        return [f"lora.{changed[0]} is set but lora.mode is null: set lora.mode=naive|exact|fold"] if changed else []
    if c.mode not in MODES:
        return [f"lora.mode must be {'|'.join(MODES)} (or null: off), got {c.mode!r}"]
    errs: List[str] = []
    if isinstance(c.r, bool) or not isinstance(c.r, int) or c.r < 1:
        errs.append(f"lora.r must be an integer >= 1, got {c.r!r}")
    if c.ranks is not None:
        if len(c.ranks) == 0:
            errs.append("lora.ranks must be a non-empty list of ranks (client c trains at ranks[c % len]), got []")
        else:
            bad = [x for x in c.ranks if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= c.r]
            if bad:
                errs.append(f"lora.ranks must hold integers in [1, lora.r={c.r}] (the server's rank), got {bad[0]!r}")
    if c.target_modules is not None and (len(c.target_modules) == 0 or any(not t for t in c.target_modules)):
        errs.append(
            f"lora.target_modules must be a non-empty list of layer names (or null: every Linear and "
            f"Conv layer), got {c.target_modules!r}"
        )
    hetero = bool(c.ranks) and any(x != c.r for x in c.ranks)
    if not _own_path(cfg) and (c.mode != "naive" or hetero):
        what = "dp.kind" if cfg.dp.kind is not None else "algorithm"
        errs.append(
            f"lora.mode={c.mode}{' with lora.ranks' if hetero else ''} aggregates the adapters itself (a "
            f"weighted average of the clients' factors): it needs algorithm.name=fedavg with no option but "
            f"weighting and no dp, got {what} {cfg.dp.kind if what == 'dp.kind' else cfg.algorithm.name!r}"
            f"{'' if what == 'dp.kind' or cfg.algorithm.name != 'fedavg' else ' with options'}; "
            "lora.mode=naive with equal ranks runs any method"
        )
    if cfg.distributed:
        errs.append("lora.mode with distributed=true is not supported (ranks exchange dense column slices)")
    if cfg.workers > 1 and (c.mode == "fold" or hetero):
        errs.append(
            f"lora.{'mode=fold' if c.mode == 'fold' else 'ranks'} with workers={cfg.workers} is not supported "
            "(the workers' models would not see the server's base weights / per-client ranks): use workers=1"
        )
    ca = cfg.clients_at_once
    if isinstance(ca, int) and not isinstance(ca, bool):
        errs.append(
            f"lora.mode with clients_at_once={ca} is not supported (the batched executor trains every "
            "parameter): use clients_at_once=off"
        )
    if hetero and cfg.compress.kind not in (None, "none"):
        errs.append(
            f"lora.ranks with compress.kind={cfg.compress.kind} is not supported (a client's row would be "
            "compressed at the server's rank, not at its own)"
        )
    if not errs:
        missing = _peft_missing()
        if missing:
            errs.append(missing)
    return errs


# ---- the model ---------------------------------------------------------------------------------------------
def _layer_names(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules() if n and isinstance(m, _LAYER_TYPES)]


def _is_peft(model: nn.Module) -> bool:
    """A model peft already wrapped (``PeftModel``, or LoRA layers injected in place)."""
    if type(model).__name__.startswith("Peft") and hasattr(model, "peft_config"):
        return True
    return any(isinstance(getattr(m, "lora_A", None), nn.ModuleDict) for m in model.modules())


def _load_base(model: nn.Module, path: str) -> None:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"lora.base: file not found: {path}") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file: one line
        raise ValueError(f"lora.base: {path} is not a torch.save'd state_dict ({type(e).__name__}: {e})") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ValueError(f"lora.base: {path} holds a {type(sd).__name__}, expected a state_dict")
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"lora.base: {path} does not fit the model: {' '.join(str(e).split())[:300]}") from None


def wrap(cfg: Any, model: nn.Module) -> nn.Module:
    """The run's model: ``model`` itself without ``lora.mode``; else the base model (``lora.base``'s weights
    loaded) wrapped by peft with LoRA layers on ``lora.target_modules``. A model that already has LoRA layers
    (a caller's ``model_fn``) is kept as it is and checked against the section by ``LoraRun``."""
    c = cfg.lora
    if c.mode is None or _is_peft(model):
        return model
    import peft

    if c.base is not None:
        _load_base(model, c.base)
    layers = _layer_names(model)
    targets = list(c.target_modules) if c.target_modules is not None else layers
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in layers):
            raise ValueError(
                f"lora.target_modules: the model {cfg.model.name!r} has no Linear or Conv layer named "
                f"{t!r} (its layers: {', '.join(layers) or 'none'})"
            )
    if not targets:
        raise ValueError(f"lora.mode={c.mode}: the model {cfg.model.name!r} has no Linear or Conv layer to adapt")
    conf = peft.LoraConfig(
        r=int(c.r),
        lora_alpha=float(c.alpha),
        target_modules=targets,
        lora_dropout=float(c.dropout),
        use_rslora=bool(c.rslora),
    )
    return peft.get_peft_model(model, conf)


def _scaling(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


class LoraRun:
    """A LoRA run's flat space, client ranks, server step and state (see the module docstring)."""

    def __init__(self, cfg: Any, model: nn.Module):
        c = cfg.lora
        self.cfg, self.mode = cfg, c.mode
        if cfg.clients_at_once == "auto":  # the batched executor trains every parameter: one at a time
            cfg.clients_at_once = "off"
        adapters = LoraSpec.from_model(model)  # "the model has no LoRA layers": one line
        bad = [l for l in adapters.layers if l.rank != c.r]
        if bad:
            raise ValueError(
                f"lora.r={c.r} but the model's LoRA layer {bad[0].name!r} has rank {bad[0].rank} "
                f"(the server's rank and the model's must match)"
            )
        flat = FlatSpec.from_module(model, trainable_only=True)  # adapters (+ other trainable tensors, buffers)
        pos = {e.name: e for e in flat.entries}
        layers = []
        for l, (ea, eb) in zip(adapters.layers, zip(adapters.flat.entries[0::2], adapters.flat.entries[1::2])):
            fa, fb = pos.get(ea.name), pos.get(eb.name)
            if fa is None or fb is None:
                raise ValueError(f"lora: layer {l.name!r}'s adapters are not trainable (requires_grad=False)")
            layers.append(replace(l, a=fa.slice, b=fb.slice))
        self.spec = LoraSpec(flat, layers, adapters.adapter)
        self.flat: FlatSpec = flat
        self.num_clients = int(cfg.num_clients)
        R = int(c.r)
        self.client_ranks = (
            [int(c.ranks[i % len(c.ranks)]) for i in range(self.num_clients)] if c.ranks is not None else None
        )
        self.hetero = self.client_ranks is not None and any(r != R for r in self.client_ranks)
        self.own = _own_path(cfg)
        weighting = cfg.algorithm.options.get("weighting", "samples")
        self.agg = LoraAggregator(self.spec, mode=self.mode, weighting=weighting) if self.own else None
        self.lora_round: Optional[LoraRound] = None  # the aggregator's round (the run's on_bad_update: first round)
        self.elt = torch.empty((), dtype=flat.dtype).element_size()
        self.lora_numel = sum(l.a.stop - l.a.start + l.b.stop - l.b.start for l in layers)
        self.scaling = _scaling(float(c.alpha), R, bool(c.rslora))
        self._rank_now = R
        self._params: Dict[str, nn.Parameter] = dict(model.named_parameters())
        if self.hetero:
            self._hook(model)

    # ---- clients ----------------------------------------------------------------------------------------
    def rank_of(self, cid: int) -> int:
        return self.client_ranks[cid] if self.client_ranks is not None else int(self.cfg.lora.r)

    def _hook(self, model: nn.Module) -> None:
        """Gradient hooks on every LoRA factor: the components beyond the training client's rank get none."""
        names = {e.slice.start: e.name for e in self.flat.entries}
        for l in self.spec.layers:
            self._params[names[l.a.start]].register_hook(lambda g: self._mask(g, 0))
            self._params[names[l.b.start]].register_hook(lambda g: self._mask(g, 1))

    def _mask(self, g: torch.Tensor, dim: int) -> torch.Tensor:
        r = self._rank_now
        if r >= g.shape[dim]:
            return g
        g = g.clone()
        g.narrow(dim, r, g.shape[dim] - r).zero_()
        return g

    def client_start(self, cid: int, global_flat: torch.Tensor) -> torch.Tensor:
        """What client ``cid`` starts its local training from: the global vector, at its rank (its first
        r_c components; the rest zero) for a lower-rank client. Sets the gradient hooks' rank."""
        r = self.rank_of(cid)
        self._rank_now = r
        if r >= int(self.cfg.lora.r):
            return global_flat
        return self.spec.truncate(global_flat, r)

    def client_bytes(self, cid: int) -> int:
        """What client ``cid`` sends uncompressed: its adapters at its rank and its other trainable tensors."""
        R, r = int(self.cfg.lora.r), self.rank_of(cid)
        return (self.flat.d - self.lora_numel + self.lora_numel * r // R) * self.elt

    # ---- the server ---------------------------------------------------------------------------------------
    def aggregate(
        self,
        agg: Any,
        global_flat: torch.Tensor,
        model: nn.Module,
        codec: Any,
        U: torch.Tensor,
        n: Sequence[float],
        ids: Sequence[int],
        payloads: Any,
        r: int,
        **kw: Any,
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """The round's new global adapters and its info (``bytes_sent``, the mode's distances, exclusions):
        ``agg`` the run's method, ``model`` the peft model (fold writes its base weights), ``codec`` the
        run's compression (sim/compression.py) or None."""
        K = len(ids)
        dense = K * self.flat.d * self.elt
        if not self.own:  # the method's own round on the adapter rows (naive, equal ranks)
            if codec is not None:
                new, info = codec.aggregate(agg, global_flat, U, n, ids, payloads, r)
            else:
                new, info = agg.aggregate(global_flat, U, n, ids, payloads, **kw)
                info = dict(info, bytes_sent=sum(self.client_bytes(c) for c in ids), bytes_dense=dense)
            return new, dict(info, lora_mode=self.mode)
        G = global_flat
        rows = U[:K]
        info: Dict[str, Any] = {}
        if codec is not None:  # each row as its client sent it, decoded: the factors are needed
            enc = codec.codec.encode_rows(rows, ids, r)
            info.update(codec=codec.codec.describe(), bytes_sent=int(sum(enc.nbytes())))
            rows = enc.dense().to(G.dtype)
        else:
            info["bytes_sent"] = sum(self.client_bytes(c) for c in ids)
        info["bytes_dense"] = dense
        if self.lora_round is None:  # the round runner's: validation, the NaN/Inf screen, the run's on_bad_update
            self.lora_round = LoraRound(self.agg, self.client_ranks, on_bad_update=agg.on_bad_update)
        res = self.lora_round.aggregate(G, rows, n, ids)
        li = res.info
        if li.get("skipped"):  # every row excluded: the global adapters as they were
            info.update(skipped=True, reason=li["reason"], excluded=li.get("excluded", []))
            return res.params, info
        if li["residuals"]:  # fold: the residual into the frozen base weights
            self.spec.fold_(model, li["residuals"])
        info.update(
            lora_mode=self.mode,
            weights=li["weights"],
            client_ranks=li["client_ranks"],
            error_to_true_average=li["error_to_true_average"],
            naive_error_to_true_average=li["naive_error_to_true_average"],
            relative_error=li["relative_error"],
            naive_relative_error=li["naive_relative_error"],
            true_update_norm=li["true_norm"],
        )
        if "excluded" in li:
            info["excluded"] = li["excluded"]
        return res.params, info

    # ---- state and provenance --------------------------------------------------------------------------------
    def _bases(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        from ..lora import _lora_layers

        _, found = _lora_layers(model, self.spec.adapter, "lora")
        return {f.name: f.base for f in found}

    def state_dict(self, model: nn.Module) -> Dict[str, Any]:
        """fold: the base weights of the LoRA layers (the residuals folded so far); nothing otherwise."""
        if self.mode != "fold":
            return {}
        return {"base": {k: v.detach().cpu().clone() for k, v in self._bases(model).items()}}

    def load_state_dict(self, model: nn.Module, st: Dict[str, Any]) -> None:
        if self.mode != "fold":
            return
        bases, saved = self._bases(model), (st or {}).get("base")
        if saved is None or set(saved) != set(bases):
            raise ValueError("lora: the checkpoint holds no fold base weights for this model's LoRA layers")
        with torch.no_grad():
            for k, t in bases.items():
                t.copy_(saved[k].to(t.device, t.dtype))

    def describe(self) -> Dict[str, Any]:
        c = self.cfg.lora
        out: Dict[str, Any] = {
            "mode": c.mode,
            "r": int(c.r),
            "alpha": float(c.alpha),
            "rslora": bool(c.rslora),
            "scaling": self.scaling,
            "layers": {l.name: {"rank": l.rank, "fan_in": l.fan_in, "fan_out": l.fan_out} for l in self.spec.layers},
            "d_trainable": self.flat.d,
            "d_adapters": self.lora_numel,
            "aggregation": "fedkernels.lora.LoraAggregator" if self.own else f"the method ({self.cfg.algorithm.name})",
            "base": c.base,
        }
        if self.client_ranks is not None:
            out["client_ranks"] = self.client_ranks
        return out


def for_run(cfg: Any, model: nn.Module) -> Optional[LoraRun]:
    """The run's LoRA side, or None without ``lora.mode``."""
    return None if cfg.lora.mode is None else LoraRun(cfg, model)
