"""Flat parameter space: a model <-> one flat vector, and the K x d client-update buffer.

``FlatSpec.from_module(model)`` records, for every parameter and float buffer (``include_buffers=False``: parameters only), its
name, shape, offset in the flat vector, numel, kind and position from the output layer, so that
layer-aware rules (GC channel rows, FedPGVC / GC-Fed classifier layers) work on views of a flat
vector without copies. Aggregators see only flat vectors and a K x d matrix.

Sign convention used everywhere in fedkernels: a client *update* is ``local_model - global_model``
(FedAvg then is ``global + sum_k p_k U_k``). Methods defined on pseudo-gradients
``global - local`` negate internally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)
_CONV_TYPES = (nn.modules.conv._ConvNd,)
KINDS = ("conv", "linear", "vector", "norm", "other")


@dataclass(frozen=True)
class ParamEntry:
    """One tensor of the flat vector."""

    name: str  # e.g. "features.0.weight"
    module: str  # owning module name, e.g. "features.0"
    shape: tuple
    offset: int
    numel: int
    kind: str  # conv | linear | vector | norm | other
    index: int  # position in named_parameters() order (buffers after parameters)
    layer_from_output: int  # 0 = the last parameterised module (output layer), 1 = the one before, ...
    is_buffer: bool = False

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.numel)

    @property
    def rows(self) -> int:
        """Output-channel rows (dim 0) for GC; 1 for scalars."""
        return self.shape[0] if len(self.shape) >= 1 else 1

    @property
    def fan_in(self) -> int:
        """Row length: numel / rows."""
        return self.numel // max(self.rows, 1)


def _kind(module: nn.Module, tensor: torch.Tensor) -> str:
    if isinstance(module, _NORM_TYPES):
        return "norm"
    if tensor.dim() <= 1:
        return "vector"
    if isinstance(module, _CONV_TYPES):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    return "other"


@dataclass
class FlatSpec:
    """Layout of a model's tensors inside one flat vector of length ``d``."""

    entries: List[ParamEntry]
    d: int
    dtype: torch.dtype = torch.float32
    _by_name: Dict[str, ParamEntry] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {e.name: e for e in self.entries}

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_module(cls, model: nn.Module, include_buffers: bool = True, trainable_only: bool = False) -> "FlatSpec":
        """Records every parameter and, with ``include_buffers`` (the default), every float buffer
        (BatchNorm running statistics) after them: the flat vector is the model's floating-point
        state, the one the simulator aggregates. ``include_buffers=False``: parameters only."""
        modules = dict(model.named_modules())
        # (name, module_name, module, tensor, is_buffer)
        owners: List[Tuple[str, str, nn.Module, torch.Tensor, bool]] = []
        for name, p in model.named_parameters():
            if trainable_only and not p.requires_grad:
                continue
            mname = name.rsplit(".", 1)[0] if "." in name else ""
            owners.append((name, mname, modules[mname], p, False))
        if include_buffers:
            for name, b in model.named_buffers():
                if b.is_floating_point():
                    mname = name.rsplit(".", 1)[0] if "." in name else ""
                    owners.append((name, mname, modules[mname], b, True))
        # parameterised modules in order of first appearance, counted back from the output
        order: List[str] = []
        for _, mname, _, _, isbuf in owners:
            if not isbuf and mname not in order:
                order.append(mname)
        pos = {m: len(order) - 1 - i for i, m in enumerate(order)}
        entries, off = [], 0
        dtypes = set()
        for i, (name, mname, mod, t, isbuf) in enumerate(owners):
            n = t.numel()
            entries.append(
                ParamEntry(
                    name=name,
                    module=mname,
                    shape=tuple(t.shape),
                    offset=off,
                    numel=n,
                    kind=_kind(mod, t),
                    index=i,
                    layer_from_output=pos.get(mname, -1),
                    is_buffer=isbuf,
                )
            )
            dtypes.add(t.dtype)
            off += n
        dtype = torch.float32 if len(dtypes) != 1 else dtypes.pop()
        return cls(entries=entries, d=off, dtype=dtype)

    # ---- lookup --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[ParamEntry]:
        return iter(self.entries)

    def __getitem__(self, name: str) -> ParamEntry:
        return self._by_name[name]

    @property
    def names(self) -> List[str]:
        return [e.name for e in self.entries]

    def select(self, pred: Callable[[ParamEntry], bool]) -> List[ParamEntry]:
        return [e for e in self.entries if pred(e)]

    def mask(
        self, pred: Callable[[ParamEntry], bool], device: Optional[Union[str, torch.device]] = None
    ) -> torch.Tensor:
        """[d] bool mask of the entries where ``pred`` holds."""
        m = torch.zeros(self.d, dtype=torch.bool, device=device)
        for e in self.entries:
            if pred(e):
                m[e.slice] = True
        return m

    def ranges(self, pred: Callable[[ParamEntry], bool]) -> List[tuple]:
        """Merged [start, stop) ranges of the entries where ``pred`` holds."""
        out: List[list] = []
        for e in self.entries:
            if pred(e):
                if out and out[-1][1] == e.offset:
                    out[-1][1] = e.offset + e.numel
                else:
                    out.append([e.offset, e.offset + e.numel])
        return [tuple(r) for r in out]

    def layer_modules(self) -> List[str]:
        """Parameterised module names from input to output."""
        seen: List[str] = []
        for e in self.entries:
            if not e.is_buffer and e.module not in seen:
                seen.append(e.module)
        return seen

    # ---- views and copies ------------------------------------------------------------------------
    def _check_vec(self, vec: torch.Tensor, name: str = "vec") -> None:
        if not isinstance(vec, torch.Tensor) or vec.dim() != 1 or vec.numel() != self.d:
            got = tuple(vec.shape) if isinstance(vec, torch.Tensor) else type(vec).__name__
            raise ValueError(f"FlatSpec: {name} must be a 1-D tensor of length d={self.d}, got {got}")

    def view(self, vec: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor ``name`` as a view into ``vec`` (no copy)."""
        self._check_vec(vec)
        e = self._by_name[name]
        return vec[e.slice].view(e.shape)

    def views(self, vec: torch.Tensor) -> Dict[str, torch.Tensor]:
        """All tensors as views into ``vec`` (no copy), by name."""
        self._check_vec(vec)
        return {e.name: vec[e.slice].view(e.shape) for e in self.entries}

    def _tensors(self, model: nn.Module) -> List[torch.Tensor]:
        params = dict(model.named_parameters())
        bufs = dict(model.named_buffers())
        try:
            return [(bufs if e.is_buffer else params)[e.name] for e in self.entries]
        except KeyError as err:
            raise ValueError(f"FlatSpec: model has no tensor {err} recorded in this spec") from None

    def flatten(self, model: nn.Module, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Copies the model's tensors into ``out`` (allocated if None) and returns it."""
        ts = self._tensors(model)
        if out is None:
            out = torch.empty(self.d, dtype=self.dtype, device=ts[0].device if ts else None)
        self._check_vec(out, "out")
        with torch.no_grad():
            dst = [out[e.slice].view(e.shape) for e in self.entries]
            if dst:
                torch._foreach_copy_(dst, [t.detach() for t in ts])
        return out

    def load_(self, model: nn.Module, vec: torch.Tensor) -> nn.Module:
        """Copies ``vec`` into the model's tensors in place (one copy, no temporaries)."""
        self._check_vec(vec)
        ts = self._tensors(model)
        with torch.no_grad():
            if ts:
                torch._foreach_copy_(ts, [vec[e.slice].view(e.shape) for e in self.entries])
        return model

    def bind_(self, model: nn.Module, vec: torch.Tensor) -> nn.Module:
        """Makes the model's tensors *views* of ``vec`` (after copying their values in), so a flat
        vector and the model share memory: no flatten/load copies during local training."""
        self._check_vec(vec)
        ts = self._tensors(model)
        with torch.no_grad():
            for e, t in zip(self.entries, ts):
                v = vec[e.slice].view(e.shape)
                v.copy_(t)
                t.data = v
        return model


class UpdateBuffer:
    """A preallocated K x d matrix whose row k a client fills in place with its update.

    ``slot = buf.add(client_id, num_examples)`` reserves the next row; the client then writes
    ``buf.row(slot)`` (or calls ``buf.write_delta(slot, model, global_flat)``). ``buf.matrix()``
    is the [count, d] view the aggregator reads. ``reset()`` starts a new round without reallocating.
    """

    def __init__(
        self,
        K: int,
        spec_or_d: Union[FlatSpec, int],
        device: Optional[Union[str, torch.device]] = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        d = spec_or_d.d if isinstance(spec_or_d, FlatSpec) else int(spec_or_d)
        if not isinstance(K, int) or K < 1:
            raise ValueError(f"UpdateBuffer: K must be a positive int, got {K!r}")
        self.spec = spec_or_d if isinstance(spec_or_d, FlatSpec) else None
        self.K, self.d = K, d
        from ._memory import check_alloc

        es = torch.empty((), dtype=dtype).element_size()
        # Row stride padded to 16 bytes (128 bytes for rows of 4 KiB and more), so every row starts
        # aligned for the 16-byte vector loads of the CUDA kernels (bf16/fp16 rows of odd length
        # would otherwise all take the scalar path); ``data`` is the [K, d] view of the padded block.
        pad = (128 if d * es >= 4096 else 16) // es
        ld = -(-d // pad) * pad
        check_alloc(
            K * ld * es,
            f"UpdateBuffer K={K} x d={d} {dtype}",
            device,
            hint="Aggregate in column chunks (fedkernels.streaming), store updates in bfloat16, "
            "or use fewer clients per round.",
        )
        self.data = torch.zeros(K, ld, device=device, dtype=dtype)[:, :d]
        self.client_ids: List[int] = []
        self.num_examples: List[float] = []

    def reset(self) -> None:
        self.client_ids.clear()
        self.num_examples.clear()

    @property
    def count(self) -> int:
        return len(self.client_ids)

    def add(self, client_id: int, num_examples: float = 1.0) -> int:
        if self.count >= self.K:
            raise ValueError(f"UpdateBuffer: all K={self.K} rows are used this round (call reset())")
        self.client_ids.append(int(client_id))
        self.num_examples.append(float(num_examples))
        return self.count - 1

    def row(self, slot: int) -> torch.Tensor:
        if not 0 <= slot < self.K:
            raise ValueError(f"UpdateBuffer: slot must be in [0, {self.K}), got {slot}")
        return self.data[slot]

    def write_delta(
        self, slot: int, model: nn.Module, global_flat: torch.Tensor, clip: Optional[float] = None
    ) -> torch.Tensor:
        """row[slot] = flatten(model) - global_flat, written in place; with ``clip``, then scaled to norm at
        most ``clip`` while the row is hot (client-side clipping of differential privacy: :func:`clip_rows_`)."""
        if self.spec is None:
            raise ValueError("UpdateBuffer.write_delta needs a buffer built from a FlatSpec")
        r = self.row(slot)
        self.spec.flatten(model, out=r)
        r.sub_(global_flat.to(r.dtype))
        if clip is not None:
            clip_rows_(r.unsqueeze(0), clip)
        return r

    def matrix(self) -> torch.Tensor:
        """The [count, d] view of the rows filled this round."""
        return self.data[: self.count]

    def weights(self) -> torch.Tensor:
        return torch.tensor(self.num_examples, dtype=torch.float64)


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """[n] float64 host: the L2 norm of each row of ``rows`` ([n, d], unit column stride), every element
    converted exactly to float64 and accumulated in float64 in a fixed order (``ops.kstats``' squared
    norms: one native pass); NaN/Inf for a row holding one."""
    from . import ops

    n = rows.size(0)
    return ops.kstats(rows, torch.full((n,), 1.0 / max(n, 1), dtype=torch.float64))[1].cpu().sqrt()


def clip_rows_(rows: torch.Tensor, clip: float) -> torch.Tensor:
    """In place: each row of ``rows`` ([n, d]) scaled to L2 norm at most ``clip``, ``u * min(1, clip / ||u||)``
    (the norm accumulated in float64, :func:`row_norms`; Flower's ``clip_inputs_inplace``): the clients'
    clipping under client-side differential privacy. Returns ``rows``."""
    norms = row_norms(rows).to(rows.device)
    over = norms > clip
    if bool(over.any()):
        s = torch.where(over, clip / norms, torch.ones_like(norms))
        rows.mul_(s.to(rows.dtype).unsqueeze(1) if rows.dtype != torch.float64 else s.unsqueeze(1))
    return rows
