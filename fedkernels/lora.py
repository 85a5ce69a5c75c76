"""LoRA-aware aggregation of adapters of models wrapped with Hugging Face ``peft``.

A LoRA layer adds ``s * B @ A`` to a frozen weight ``W0`` (``A``: [r, fan_in], ``B``: [fan_out, r],
``s = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA). Clients fine-tune only ``A`` and
``B``, so only the adapters travel and are aggregated. The average of the clients' weights is
``W0 + s * sum_k p_k B_k A_k``; averaging the factors separately (what Flower's FlowerTune, pfl and
NVFlare's PEFT recipes do) gives ``W0 + s * (sum_k p_k B_k)(sum_k p_k A_k)`` instead, which is not it.

``LoraSpec.from_model(model)`` is a :class:`fedkernels.flat.FlatSpec` over the adapter parameters
only (each LoRA layer's ``A`` then ``B``; the frozen base and everything else excluded), with the
map layer -> (A slice, B slice, shapes, rank, scaling). ``LoraAggregator(spec, mode)`` aggregates K
clients' adapter vectors (a [K, d] matrix of the clients' adapters, not differences: the products
need the factors themselves) with sample weights ``p_k = n_k / sum n``:

- ``naive``: A and B averaged separately (one ``ops.weighted_sum`` pass over the rows);
- ``exact``: per layer the weighted sum of the products ``M = sum_k p_k B_k A_k`` (the true average
  update), re-factorised to the server's rank r by a truncated SVD as FlexLoRA does (Bai et al.
  2024): ``M ~ U_r S_r V_r^T``, ``B = U_r S_r^(1/2)``, ``A = S_r^(1/2) V_r^T`` (the square root of
  the singular values split evenly between the factors; each singular pair's sign fixed so that the
  largest entry of its left vector is positive). With ``r >= sum_k r_k`` this is ``M`` itself; below
  it, the best rank-r approximation (Eckart-Young);
- ``fold``: the factors averaged as in ``naive`` and the residual ``s * (M - B_avg A_avg)`` returned
  per layer, to be added to the frozen base weight (``LoraSpec.fold_``), as FedEx-LoRA does
  (Singhal et al. 2025): base + product is then exactly the true average.

Heterogeneous ranks (FlexLoRA, HLoRA, HeteroLoRA): the flat vector is always at the server's rank R
and scaling; a client of rank r_k <= R is flattened zero-padded (A's rows and B's columns beyond
r_k are zero) with B rescaled by ``s_k / s`` so the padded factors give the client's own update,
and ``LoraSpec.load_`` into a client model keeps the first r_k components (after ``exact``: the
client's best rank-r_k approximation of the average, as FlexLoRA redistributes it).

Cost per layer (fan_out m, fan_in n, K clients of rank r): a QR of the stacked ``[B_1 .. B_K]``
(m x Kr) and ``[A_1; ..; A_K]^T`` (n x Kr), and an SVD of the Kr x Kr core ``R_B diag(p) R_A^T``:
O((m + n) (Kr)^2 + (Kr)^3) in float64 through torch's LAPACK, never the dense m x n product
(``fold`` writes one dense m x n residual per layer). The one flat pass (the factor average and
the rows' NaN/Inf screen) is ``ops.weighted_sum_screened``; the per-layer work reads the layer's
K x r (m + n) factors once, converted to float64, one layer at a time. The errors against the true
average reported in ``info`` are computed in the same core coordinates, exactly (no cancellation of large norms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .algorithms.base import AggResult, Aggregator, RoundInput
from .flat import FlatSpec, ParamEntry

__all__ = ["LoraLayer", "LoraSpec", "LoraAggregator", "LoraResult", "LoraRound", "MODES"]

MODES = ("naive", "exact", "fold")


@dataclass(frozen=True)
class LoraLayer:
    """One LoRA layer of the flat adapter vector."""

    name: str  # the LoRA module's name in the model, e.g. "base_model.model.fc1"
    a: slice  # A's slice of the flat vector ([rank, fan_in] row-major)
    b: slice  # B's slice ([fan_out, rank] row-major)
    a_shape: Tuple[int, ...]  # A's parameter shape (Linear: (r, in); conv: (r, in, *kernel))
    b_shape: Tuple[int, ...]  # B's parameter shape (Linear: (out, r); conv: (out, r, 1, ...))
    rank: int
    scaling: float  # s: the layer adds s * B @ A to its base weight
    fan_in: int
    fan_out: int
    weight_shape: Tuple[int, ...]  # the frozen base weight's shape
    fan_in_fan_out: bool = False  # base weight stored transposed (GPT-2's Conv1D)

    def factors(self, vec: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(B [fan_out, rank], A [rank, fan_in]) as views of ``vec`` (one adapter vector)."""
        return vec[self.b].view(self.fan_out, self.rank), vec[self.a].view(self.rank, self.fan_in)

    def delta(self, vec: torch.Tensor) -> torch.Tensor:
        """``s * B @ A`` in the base weight's shape (what peft's ``get_delta_weight`` adds)."""
        B, A = self.factors(vec)
        return self.to_weight(self.scaling * (B @ A))

    def to_weight(self, m: torch.Tensor) -> torch.Tensor:
        """A [fan_out, fan_in] matrix in the base weight's layout."""
        return (m.t() if self.fan_in_fan_out else m).reshape(self.weight_shape)


@dataclass
class _Found:
    name: str
    A: torch.Tensor
    B: torch.Tensor
    A_name: str
    B_name: str
    rank: int
    scaling: float
    base: torch.Tensor
    base_name: str
    fan_in_fan_out: bool


def _lora_layers(model: nn.Module, adapter: Optional[str], who: str) -> Tuple[str, List[_Found]]:
    """The LoRA layers of a peft model (duck-typed on peft's ``LoraLayer`` attributes: ``lora_A`` /
    ``lora_B`` ModuleDicts keyed by adapter name, ``scaling``, ``r``), in ``named_modules`` order."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{who}: model must be a torch.nn.Module (a peft model), got {type(model).__name__}")
    found: List[_Found] = []
    names = {id(p): n for n, p in model.named_parameters()}
    for mname, m in model.named_modules():
        la, lb = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
        if not isinstance(la, nn.ModuleDict) or not isinstance(lb, nn.ModuleDict):
            continue
        emb = getattr(m, "lora_embedding_A", None)
        if isinstance(emb, nn.ParameterDict) and len(emb) > 0:
            raise ValueError(
                f"{who}: layer {mname!r} has an embedding LoRA adapter; only Linear and "
                "convolution LoRA layers are supported"
            )
        if len(la) == 0:
            continue
        if adapter is None:
            keys = list(la.keys())
            if len(keys) != 1:
                raise ValueError(f"{who}: layer {mname!r} has adapters {keys}; name the one to aggregate with adapter=")
            adapter = keys[0]
        if adapter not in la or adapter not in lb:
            raise ValueError(f"{who}: layer {mname!r} has no adapter {adapter!r} (it has {list(la.keys())})")
        mag = getattr(m, "lora_magnitude_vector", None)
        if isinstance(mag, nn.ModuleDict) and adapter in mag:
            raise ValueError(
                f"{who}: layer {mname!r} uses DoRA (use_dora=True); its update is not s * B @ A, "
                "use a plain LoRA adapter"
            )
        a_mod, b_mod = la[adapter], lb[adapter]
        if getattr(b_mod, "bias", None) is not None:
            raise ValueError(f"{who}: layer {mname!r} has a LoRA bias (lora_bias=True); not supported")
        if getattr(a_mod, "groups", 1) != 1:
            raise ValueError(f"{who}: layer {mname!r} is a grouped convolution; not supported")
        A, B = a_mod.weight, b_mod.weight
        r = int(A.shape[0])
        if B.dim() < 2 or B.shape[1] != r or any(s != 1 for s in B.shape[2:]):
            raise ValueError(
                f"{who}: layer {mname!r} has A of shape {tuple(A.shape)} and B of shape "
                f"{tuple(B.shape)}; expected B [fan_out, {r}, 1, ...]"
            )
        base_layer = m.get_base_layer() if hasattr(m, "get_base_layer") else getattr(m, "base_layer", None)
        base = getattr(base_layer, "weight", None)
        if not isinstance(base, torch.Tensor):
            raise ValueError(f"{who}: layer {mname!r} has no base weight")
        scaling = m.scaling[adapter] if hasattr(m, "scaling") else 1.0
        found.append(
            _Found(
                name=mname,
                A=A,
                B=B,
                A_name=names[id(A)],
                B_name=names[id(B)],
                rank=r,
                scaling=float(scaling),
                base=base,
                base_name=names.get(id(base), mname + ".weight"),
                fan_in_fan_out=bool(getattr(m, "fan_in_fan_out", False)),
            )
        )
    if not found:
        raise ValueError(
            f"{who}: the model has no LoRA layers (wrap it with peft.get_peft_model and a "
            "LoraConfig whose target_modules match some of its layers)"
        )
    return adapter or "default", found


class LoraSpec:
    """The adapter parameters of a peft model as one flat vector (``flat``: a FlatSpec over them only)
    and its LoRA layers (``layers``), at the server's ranks and scalings."""

    def __init__(self, flat: FlatSpec, layers: List[LoraLayer], adapter: str) -> None:
        self.flat, self.layers, self.adapter = flat, layers, adapter
        self._by_name = {l.name: l for l in layers}

    @classmethod
    def from_model(cls, model: nn.Module, adapter: Optional[str] = None) -> "LoraSpec":
        adapter, found = _lora_layers(model, adapter, "LoraSpec.from_model")
        entries: List[ParamEntry] = []
        layers: List[LoraLayer] = []
        off = 0
        dtypes = set()
        n = len(found)
        for i, f in enumerate(found):
            kind = "linear" if f.A.dim() == 2 else "conv"
            sl = {}
            for which, t, pname in (("a", f.A, f.A_name), ("b", f.B, f.B_name)):
                entries.append(
                    ParamEntry(
                        name=pname,
                        module=pname.rsplit(".", 1)[0],
                        shape=tuple(t.shape),
                        offset=off,
                        numel=t.numel(),
                        kind=kind,
                        index=len(entries),
                        layer_from_output=n - 1 - i,
                    )
                )
                sl[which] = slice(off, off + t.numel())
                off += t.numel()
                dtypes.add(t.dtype)
            fan_in = f.A.numel() // f.rank
            fan_out = f.B.shape[0]
            ws = tuple(f.base.shape)
            want = fan_in * fan_out
            if math.prod(ws) != want:
                raise ValueError(
                    f"LoraSpec.from_model: layer {f.name!r} has a base weight of shape {ws} but "
                    f"B @ A is {fan_out} x {fan_in}"
                )
            layers.append(
                LoraLayer(
                    name=f.name,
                    a=sl["a"],
                    b=sl["b"],
                    a_shape=tuple(f.A.shape),
                    b_shape=tuple(f.B.shape),
                    rank=f.rank,
                    scaling=f.scaling,
                    fan_in=fan_in,
                    fan_out=fan_out,
                    weight_shape=ws,
                    fan_in_fan_out=f.fan_in_fan_out,
                )
            )
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        return cls(FlatSpec(entries=entries, d=off, dtype=dtype), layers, adapter)

    @property
    def d(self) -> int:
        return self.flat.d

    def __getitem__(self, name: str) -> LoraLayer:
        return self._by_name[name]

    def ranks(self) -> Dict[str, int]:
        return {l.name: l.rank for l in self.layers}

    def _match(self, model: nn.Module, who: str) -> List[Tuple[LoraLayer, _Found]]:
        """The model's LoRA layers paired with the spec's: same layers, same fan-in/out, rank <= the
        server's (a lower rank is a heterogeneous-rank client)."""
        _, found = _lora_layers(model, self.adapter, who)
        got = {f.name: f for f in found}
        if set(got) != set(self._by_name):
            miss = sorted(set(self._by_name) - set(got)) or sorted(set(got) - set(self._by_name))
            raise ValueError(f"{who}: the model's LoRA layers differ from the spec's (e.g. {miss[0]!r})")
        out = []
        for l in self.layers:
            f = got[l.name]
            if f.rank > l.rank:
                raise ValueError(
                    f"{who}: layer {l.name!r} has rank {f.rank} in this model but {l.rank} in the "
                    f"server's spec; a client's rank must be <= the server's"
                )
            if f.A.numel() // f.rank != l.fan_in or f.B.shape[0] != l.fan_out or tuple(f.A.shape[1:]) != l.a_shape[1:]:
                raise ValueError(
                    f"{who}: layer {l.name!r} has A {tuple(f.A.shape)} and B {tuple(f.B.shape)}; "
                    f"the spec expects A [r, {', '.join(map(str, l.a_shape[1:]))}] and B "
                    f"[{l.fan_out}, r]"
                )
            out.append((l, f))
        return out

    def model_rank(self, model: nn.Module) -> int:
        """The model's LoRA rank (the largest over its layers): the ``client_ranks`` entry of a client."""
        return max(f.rank for _, f in self._match(model, "LoraSpec.model_rank"))

    def flatten(self, model: nn.Module, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The model's adapters as a vector of length d at the server's ranks: a lower-rank client's
        A rows and B columns zero-padded, its B scaled by s_client / s_server."""
        pairs = self._match(model, "LoraSpec.flatten")
        if out is None:
            out = torch.zeros(self.d, dtype=self.flat.dtype, device=pairs[0][1].A.device)
        else:
            self.flat._check_vec(out, "out")
            out.zero_()
        with torch.no_grad():
            for l, f in pairs:
                B, A = l.factors(out)
                A[: f.rank].copy_(f.A.detach().reshape(f.rank, l.fan_in))
                B[:, : f.rank].copy_(f.B.detach().reshape(l.fan_out, f.rank))
                if f.scaling != l.scaling:
                    B.mul_(f.scaling / l.scaling)
        return out

    def load_(self, model: nn.Module, vec: torch.Tensor) -> nn.Module:
        """Copies ``vec`` into the model's adapters; a lower-rank client gets the first r_k components
        (its B scaled back by s_server / s_client)."""
        self.flat._check_vec(vec)
        with torch.no_grad():
            for l, f in self._match(model, "LoraSpec.load_"):
                B, A = l.factors(vec)
                f.A.copy_(A[: f.rank].reshape(f.A.shape))
                b = B[:, : f.rank]
                if f.scaling != l.scaling:
                    b = b * (l.scaling / f.scaling)
                f.B.copy_(b.reshape(f.B.shape))
        return model

    def truncate(self, vec: torch.Tensor, rank: int) -> torch.Tensor:
        """A copy of ``vec`` with every layer's components beyond ``rank`` zeroed (a rank-``rank``
        client's share, still in the server's layout)."""
        self.flat._check_vec(vec)
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoraSpec.truncate: rank must be a positive int, got {rank!r}")
        v = vec.clone()
        for l in self.layers:
            B, A = l.factors(v)
            A[rank:].zero_()
            B[:, rank:].zero_()
        return v

    def fold_(self, model: nn.Module, residuals: Dict[str, torch.Tensor]) -> nn.Module:
        """Adds ``fold`` mode's residuals to the model's frozen base weights (in place)."""
        _, found = _lora_layers(model, self.adapter, "LoraSpec.fold_")
        got = {f.name: f for f in found}
        with torch.no_grad():
            for name, r in residuals.items():
                if name not in got:
                    raise ValueError(f"LoraSpec.fold_: the model has no LoRA layer {name!r}")
                base = got[name].base
                if tuple(r.shape) != tuple(base.shape):
                    raise ValueError(
                        f"LoraSpec.fold_: residual of {name!r} has shape {tuple(r.shape)}, the base "
                        f"weight {tuple(base.shape)}"
                    )
                base.add_(r.to(base.dtype))
        return model


@dataclass
class LoraResult:
    """``adapter``: the new global adapter vector [d]; ``residuals``: per layer, the tensor to add to
    the base weight (``fold`` mode, else empty); ``info``: weights, per-layer and total errors."""

    adapter: torch.Tensor
    residuals: Dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def _fix_signs(U: torch.Tensor, Vh: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flip each singular pair so that the largest-magnitude entry of its left vector is positive."""
    idx = U.abs().argmax(dim=0)
    sgn = torch.sign(U.gather(0, idx[None]).squeeze(0))
    sgn[sgn == 0] = 1
    return U * sgn, Vh * sgn[:, None]


class LoraAggregator:
    """Aggregates K clients' LoRA adapters (``mode``: naive | exact | fold; see the module docstring).

    ``weighting``: "samples" (p_k proportional to num_examples, Flower's FedAvg) or "uniform"."""

    def __init__(self, spec: LoraSpec, mode: str = "exact", weighting: str = "samples") -> None:
        if not isinstance(spec, LoraSpec):
            raise ValueError(
                f"LoraAggregator: spec must be a LoraSpec (LoraSpec.from_model), got {type(spec).__name__}"
            )
        if mode not in MODES:
            raise ValueError(f"LoraAggregator: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"LoraAggregator: weighting must be 'samples' or 'uniform', got {weighting!r}")
        self.spec, self.mode, self.weighting = spec, mode, weighting

    def _weights(self, K: int, num_examples: object) -> torch.Tensor:
        if self.weighting == "uniform" or num_examples is None:
            return torch.full((K,), 1.0 / K, dtype=torch.float64)
        n = torch.as_tensor(num_examples, dtype=torch.float64).detach().cpu()
        if n.dim() != 1 or n.numel() != K:
            raise ValueError(
                f"LoraAggregator: num_examples must hold one count per client (K={K}), got shape {tuple(n.shape)}"
            )
        if not bool(torch.isfinite(n).all()) or bool((n < 0).any()) or float(n.sum()) <= 0:
            raise ValueError(f"LoraAggregator: num_examples must be finite, >= 0 and not all 0, got {n.tolist()}")
        return n / n.sum()

    def _ranks(self, K: int, client_ranks: Optional[Sequence[int]]) -> Optional[List[int]]:
        if client_ranks is None:
            return None
        rk = list(client_ranks)
        if len(rk) != K:
            raise ValueError(f"LoraAggregator: client_ranks must hold one rank per client (K={K}), got {len(rk)}")
        top = max(l.rank for l in self.spec.layers)
        for k, r in enumerate(rk):
            if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= top:
                raise ValueError(
                    f"LoraAggregator: client_ranks[{k}] must be an int in [1, {top}] (the server's rank), got {r!r}"
                )
        return rk

    def aggregate(
        self,
        adapters: torch.Tensor,
        num_examples: object = None,
        client_ranks: Optional[Sequence[int]] = None,
        global_adapter: Optional[torch.Tensor] = None,
    ) -> LoraResult:
        """``adapters``: [K, d] float, row k client k's adapter vector (``spec.flatten(client_model)``);
        ``num_examples``: K counts (None: uniform); ``client_ranks``: K ranks (None: the server's), a
        client's components beyond its rank must be zero; ``global_adapter``: optional [d], the round's
        starting global adapters, only to report the errors relative to the true average *update*
        ``s * (sum_k p_k B_k A_k - B A)`` (without it: relative to ``s * sum_k p_k B_k A_k``).
        Returns a :class:`LoraResult`."""
        from . import ops

        spec, who = self.spec, "LoraAggregator.aggregate"
        if not isinstance(adapters, torch.Tensor) or adapters.dim() != 2 or adapters.size(1) != spec.d:
            got = tuple(adapters.shape) if isinstance(adapters, torch.Tensor) else type(adapters).__name__
            raise ValueError(
                f"{who}: adapters must be a [K, d={spec.d}] tensor (one client's adapter vector a row), got {got}"
            )
        K = adapters.size(0)
        if K == 0:
            raise ValueError(f"{who}: adapters has K=0 rows; aggregation needs at least one client")
        if not adapters.is_floating_point():
            raise ValueError(f"{who}: adapters must be a float tensor, got {adapters.dtype}")
        p = self._weights(K, num_examples)
        rk = self._ranks(K, client_ranks)
        G = None
        if global_adapter is not None:
            if (
                not isinstance(global_adapter, torch.Tensor)
                or global_adapter.dim() != 1
                or global_adapter.numel() != spec.d
                or not global_adapter.is_floating_point()
            ):
                got = (
                    tuple(global_adapter.shape)
                    if isinstance(global_adapter, torch.Tensor)
                    else type(global_adapter).__name__
                )
                raise ValueError(f"{who}: global_adapter must be a 1-D float tensor of length d={spec.d}, got {got}")
            G = global_adapter.detach().to(device=adapters.device, dtype=torch.float64)
        X = adapters.detach()
        out_dtype = X.dtype if X.dtype in (torch.float32, torch.float64) else torch.float32
        # the factors averaged separately, and the rows' NaN/Inf screen, in one pass of the weighted-sum kernel
        avg, ok = ops.weighted_sum_screened(X, p, out=torch.empty(spec.d, dtype=out_dtype, device=X.device))
        ok = ok.cpu()
        if not bool(ok.all()):
            bad = (~ok).nonzero().flatten().tolist()
            raise ValueError(f"{who}: adapters rows {bad[:8]} hold NaN or Inf")
        rk_t = None if rk is None else torch.tensor(rk, device=X.device)
        new = avg if self.mode != "exact" else avg.clone()
        residuals: Dict[str, torch.Tensor] = {}
        per_layer: Dict[str, dict] = {}
        tot_true = tot_naive = tot_err = 0.0
        for l in spec.layers:
            r, m, n = l.rank, l.fan_out, l.fan_in
            A = X[:, l.a].to(torch.float64).reshape(K, r, n)
            B = X[:, l.b].to(torch.float64).reshape(K, m, r)
            if rk_t is not None:
                beyond = torch.arange(r, device=X.device)[None, :] >= rk_t[:, None]  # [K, r]
                bad = ((A != 0).any(dim=2) | (B != 0).any(dim=1)) & beyond
                if bool(bad.any()):
                    k = int(bad.any(dim=1).nonzero()[0])
                    raise ValueError(
                        f"{who}: client {k} has client_ranks={rk[k]} but nonzero components beyond "
                        f"rank {rk[k]} in layer {l.name!r} (the server's rank is {r})"
                    )
            Kr = K * r
            Bcat = B.permute(1, 0, 2).reshape(m, Kr)  # [B_1 .. B_K]
            Acat = A.reshape(Kr, n)  # [A_1; ..; A_K]
            w = p.to(X.device).repeat_interleave(r)  # diag(p_k I_r)
            P = torch.kron(p.to(X.device)[:, None], torch.eye(r, dtype=torch.float64, device=X.device))
            if G is not None:  # the global's factors join the basis, weight 0 in M
                Bg, Ag = l.factors(G)
                Bcat, Acat = torch.cat([Bcat, Bg], 1), torch.cat([Acat, Ag], 0)
                w = torch.cat([w, w.new_zeros(r)])
                P = torch.cat([P, P.new_zeros(r, r)])
            Qb, Rb = torch.linalg.qr(Bcat)
            Qa, Ra = torch.linalg.qr(Acat.t())
            core = (Rb * w) @ Ra.t()  # M = sum_k p_k B_k A_k = Qb core Qa^T
            naive_core = (Rb @ P) @ (Ra @ P).t()  # (sum p_k B_k)(sum p_k A_k) in the same basis
            s = l.scaling
            if G is None:
                true_norm = s * float(torch.linalg.matrix_norm(core))
            else:  # the true average update M - Bg Ag
                true_norm = s * float(torch.linalg.matrix_norm(core - Rb[:, Kr:] @ Ra[:, Kr:].t()))
            err_naive = s * float(torch.linalg.matrix_norm(naive_core - core))
            row = {"rank": r, "true_norm": true_norm, "error_naive": err_naive}  # true_norm: as relative_to says
            if self.mode == "naive":
                err = err_naive
            elif self.mode == "exact":
                Uc, S, Vh = torch.linalg.svd(core, full_matrices=False)
                Uc, Vh = _fix_signs(Uc, Vh)
                t = min(r, S.numel())
                rs = S[:t].sqrt()
                Bn = torch.zeros(m, r, dtype=torch.float64, device=X.device)
                An = torch.zeros(r, n, dtype=torch.float64, device=X.device)
                Bn[:, :t] = Qb @ (Uc[:, :t] * rs)
                An[:t] = (rs[:, None] * Vh[:t]) @ Qa.t()
                Bo, Ao = l.factors(new)
                Bo.copy_(Bn)
                Ao.copy_(An)
                # the error of the factors as stored (rounded to the result's dtype), in core coordinates
                Bq, Aq = (Bo.to(torch.float64), Ao.to(torch.float64))
                err = s * float(torch.linalg.matrix_norm((Qb.t() @ Bq) @ (Aq @ Qa) - core))
                row["discarded"] = s * float(S[t:].square().sum().sqrt())
                row["singular_values"] = (s * S[: min(S.numel(), 2 * r)]).tolist()
            else:
                diff = Qb @ (core - naive_core) @ Qa.t()
                res = l.to_weight(s * diff).to(out_dtype)
                residuals[l.name] = res
                back = res.to(torch.float64)
                back = (back.reshape(n, m).t() if l.fan_in_fan_out else back.reshape(m, n)) / s
                Bo, Ao = l.factors(new)
                Bq, Aq = Bo.to(torch.float64), Ao.to(torch.float64)
                err = s * float(torch.linalg.matrix_norm((Qb.t() @ Bq) @ (Aq @ Qa) + Qb.t() @ back @ Qa - core))
            row["error"] = err
            per_layer[l.name] = row
            tot_true += true_norm**2
            tot_naive += err_naive**2
            tot_err += err**2
        tn = math.sqrt(tot_true)
        info = {
            "mode": self.mode,
            "K": K,
            "weights": p.tolist(),
            "client_ranks": rk,
            "layers": per_layer,
            "relative_to": "product" if G is None else "update",
            "true_norm": tn,
            "error_to_true_average": math.sqrt(tot_err),
            "naive_error_to_true_average": math.sqrt(tot_naive),
            "relative_error": math.sqrt(tot_err) / tn if tn > 0 else 0.0,
            "naive_relative_error": math.sqrt(tot_naive) / tn if tn > 0 else 0.0,
        }
        return LoraResult(adapter=new, residuals=residuals, info=info)


class LoraRound(Aggregator):
    """:class:`LoraAggregator`'s step as a method of the round runner (``fedkernels.algorithms.runner``): a
    round of clients' adapter *updates* (row k: client k's ``local - global``) goes through
    ``aggregate(global_adapter, updates, num_examples, client_ids)``, whose validation, NaN/Inf screen and
    ``on_bad_update`` policy (raise, or drop the bad rows and log them) are the runner's, as for every method;
    the update aggregates the accepted clients' adapters ``global + row`` with ``lora`` (its weights, ranks
    and modes as :meth:`LoraAggregator.aggregate`'s). ``client_ranks``: the rank of each client id (a
    sequence indexed by client id; None: every client at the server's rank). The result's ``info``: the
    aggregator's (``LoraResult.info``, ``client_ranks`` those of the accepted clients) and ``residuals``
    (fold: per layer, what :meth:`LoraSpec.fold_` adds to the base weights; else empty)."""

    name = "lora"

    def __new__(cls, *args: object, **kw: object) -> "LoraRound":
        return object.__new__(cls)  # (its options are LoraAggregator's, checked there)

    def __init__(
        self, lora: LoraAggregator, client_ranks: Optional[Sequence[int]] = None, on_bad_update: str = "raise"
    ) -> None:
        super().__init__(on_bad_update=on_bad_update)
        if not isinstance(lora, LoraAggregator):
            raise ValueError(f"LoraRound: lora must be a LoraAggregator, got {type(lora).__name__}")
        self.lora, self.client_ranks = lora, client_ranks

    def _aggregate(self, rin: RoundInput) -> AggResult:
        G = rin.global_flat
        X = rin.U + G  # the clients' adapters (a lower rank: its padded factors)
        ranks = None if self.client_ranks is None else [int(self.client_ranks[c]) for c in rin.client_ids]
        res = self.lora.aggregate(X, num_examples=rin.num_examples, client_ranks=ranks, global_adapter=G)
        return AggResult(res.adapter.to(G.dtype), {**res.info, "residuals": res.residuals})
