"""Derivatives and vmap rules of the native ops (registered once, at import of fedkernels.ops).

Formulas (``g`` = gradient of the output):

* ``weighted_sum``: ``out = base + alpha * sum_i coef_i U[rows_i]``
  -> ``dU[rows_i] += alpha coef_i g``, ``dcoef_i = alpha <U[rows_i], g>`` (float64 dot),
  ``dbase = g``.
* ``gram``: ``G = U[rows] U^T`` (float64) -> ``dU = gG^T U[rows]`` plus ``gG U`` scattered into
  ``rows`` (``(gG + gG^T) U`` without rows); computed in float64, returned in U's dtype.
* ``gc_project``: GC is an orthogonal projection P (per-row mean removal), so ``dX = P(g)``: the op
  itself applied to the incoming gradients.

Every other op with tensor outputs (``min_norm``, ``lu_factor``, ``lu_solve``, ``arrowhead_solve``,
``fedecado_be_step``) has no derivative here: a backward through it raises a RuntimeError naming the
op (instead of torch's silent zeros / None). ``finite_rows`` returns bool (never differentiable);
the in-place / out= variants are refused in the wrappers when an input requires grad.

vmap: ``weighted_sum`` and ``gram`` batch by a loop of native calls over the vmapped dimension
(one kernel per batch element, no K x d temporaries), instead of torch's per-sample fallback with
a performance warning; ``coef`` batched alone is one ``U^T``-style matmul-free call per element.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

# what the op wrappers return through no_derivative: one tensor or a tuple of them
Outputs = Any


# ---- weighted_sum -------------------------------------------------------------------------------
def _wsum_setup(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
    U, coef, base, alpha, rows = inputs
    ctx.alpha = float(alpha)
    ctx.has_base = base is not None
    ctx.save_for_backward(U, coef, rows)


def _wsum_backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
    U, coef, rows = ctx.saved_tensors
    a = ctx.alpha
    # trailing arguments left at their defaults are not passed on (nor counted in needs_input_grad)
    need_U, need_c, need_b = (tuple(ctx.needs_input_grad) + (False,) * 3)[:3]
    gU: Optional[torch.Tensor] = None
    gc: Optional[torch.Tensor] = None
    gb: Optional[torch.Tensor] = None
    r = None if rows is None else rows.to(U.device)
    if need_U:
        w = (a * coef.to(device=U.device, dtype=torch.float64)).to(g.dtype)
        contrib = w[:, None] * g[None, :]
        if r is None:
            gU = contrib.to(U.dtype)
        else:
            gU = torch.zeros_like(U).index_add_(0, r, contrib.to(U.dtype))
    if need_c:
        sel = U if r is None else U.index_select(0, r)
        gc = (a * (sel.to(torch.float64) @ g.to(torch.float64))).to(device=coef.device, dtype=coef.dtype)
    if need_b and ctx.has_base:
        gb = g
    return gU, gc, gb, None, None


# ---- gram ---------------------------------------------------------------------------------------
def _gram_setup(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
    U, rows = inputs
    ctx.save_for_backward(U, rows)


def _gram_backward(ctx: Any, gG: torch.Tensor) -> Tuple[torch.Tensor, None]:
    U, rows = ctx.saved_tensors
    U64 = U.to(torch.float64)
    gG = gG.to(torch.float64)
    if rows is None:
        gU = (gG + gG.transpose(0, 1)) @ U64
    else:
        r = rows.to(U.device)
        gU = gG.transpose(0, 1) @ U64.index_select(0, r)
        gU = gU.index_add(0, r, gG @ U64)
    return gU.to(U.dtype), None


# ---- gc_project ---------------------------------------------------------------------------------
def _gc_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    tensors, vector_policy, min_fanin = inputs
    ctx.policy, ctx.min_fanin = vector_policy, int(min_fanin)
    ctx.like = [(t.shape, t.dtype, t.device) for t in tensors]


def _gc_backward(ctx: Any, *grads: Any) -> Tuple[Any, ...]:
    gl: Sequence[Any] = grads
    if len(grads) == 1 and isinstance(grads[0], (list, tuple)):   # the Tensor[] output's grads, as one list
        gl = grads[0]
    gs = [torch.zeros(s, dtype=dt, device=dev) if g is None else g for g, (s, dt, dev) in zip(gl, ctx.like)]
    res = (list(torch.ops.fedkernels.gc_project(gs, ctx.policy, ctx.min_fanin)), None, None)
    # torch's Tensor[] support (torch/_library/autograd.py) matches the return against the arguments
    # as the dispatcher passed them (trailing defaults dropped, plus its metadata input, for which
    # it appends the None itself): return one entry per passed argument, minus that one
    spec = getattr(getattr(ctx, "_pt_metadata", None), "input_spec", None)
    n = getattr(spec, "num_children", None) if spec is not None else None
    return res if n is None else res[:n - 1]


# ---- ops without a derivative -------------------------------------------------------------------
_NO_DERIVATIVE = {
    "min_norm": "the Frank-Wolfe solution is piecewise in G; differentiate a smooth surrogate instead",
    "lu_factor": "use torch.linalg.lu_factor for gradients",
    "lu_solve": "use torch.linalg.lu_solve for gradients",
    "arrowhead_solve": "solve with torch.linalg.solve on the dense matrix for gradients",
    "fedecado_be_step": "it is a server-side integrator step, not a training op",
}


def _raising(name: str, hint: str) -> Tuple[Callable[..., None], Callable[..., Any]]:
    def setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        pass

    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"fedkernels.{name} has no derivative ({hint}); "
                           f"detach its inputs or compute it under torch.no_grad()")
    return setup, backward


# ---- the wrappers' differentiable path ------------------------------------------------------------
# The raw ops above carry their formulas (register_autograd), which covers torch.autograd and
# opcheck. torch.func transforms (grad, vjp, jacrev) need an autograd.Function with setup_context,
# so the wrappers take this path when an input requires grad; it reuses the same formulas.
def needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def call(op: Callable[..., Any], *args: Any) -> Any:
    """``op(*args)`` straight to its backend kernel when no gradient is needed: skips the Python
    autograd kernel that register_autograd installs (~35 us per call on the CPU). Under tracing and
    torch.func transforms the op is called normally."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


class _WeightedSum(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(U: torch.Tensor, coef: torch.Tensor, base: Optional[torch.Tensor], alpha: float,
                rows: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.fedkernels.weighted_sum(U, coef, base, alpha, rows)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
        _wsum_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        return _wsum_backward(ctx, g)


class _Gram(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(U: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.fedkernels.gram(U, rows)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
        _gram_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, gG: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return _gram_backward(ctx, gG)


class _GcProject(torch.autograd.Function):
    @staticmethod
    def forward(policy: str, min_fanin: int, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(torch.ops.fedkernels.gc_project(list(tensors), policy, min_fanin))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.policy, ctx.min_fanin = inputs[0], int(inputs[1])
        ctx.like = [(t.shape, t.dtype, t.device) for t in inputs[2:]]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Tuple[Optional[torch.Tensor], ...]:
        gs = [torch.zeros(s, dtype=dt, device=dev) if g is None else g for g, (s, dt, dev) in zip(grads, ctx.like)]
        return (None, None, *torch.ops.fedkernels.gc_project(gs, ctx.policy, ctx.min_fanin))


class _NoDerivative(torch.autograd.Function):
    """Identity on ``out`` that ties it to ``inputs`` and raises on backward, naming the op."""

    @staticmethod
    def forward(name: str, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return out.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.op = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"fedkernels.{ctx.op} has no derivative ({_NO_DERIVATIVE.get(ctx.op, '')}); "
                           "detach its inputs or compute it under torch.no_grad()")


def weighted_sum(U: torch.Tensor, coef: torch.Tensor, base: Optional[torch.Tensor], alpha: float,
                 rows: Optional[torch.Tensor]) -> torch.Tensor:
    return _WeightedSum.apply(U, coef, base, alpha, rows)


def gram(U: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    return _Gram.apply(U, rows)


def gc_project(tensors: Sequence[torch.Tensor], policy: str, min_fanin: int) -> List[torch.Tensor]:
    return list(_GcProject.apply(policy, min_fanin, *tensors))


def no_derivative(name: str, outputs: Outputs, *inputs: Any) -> Outputs:
    """``outputs`` (a tensor or a tuple) with every floating tensor made to raise on backward when
    one of ``inputs`` requires grad (the op ran on detached inputs)."""
    if not needs_grad(*inputs):
        return outputs
    grad_in = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def tie(o: Any) -> Any:
        return _NoDerivative.apply(name, o, *grad_in) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
    return tuple(tie(o) for o in outputs) if isinstance(outputs, tuple) else tie(outputs)


# ---- vmap rules ---------------------------------------------------------------------------------
def _vmap_loop(op: Callable[..., torch.Tensor], info: Any, in_dims: Sequence[Optional[int]],
               args: Sequence[Any]) -> Tuple[torch.Tensor, int]:
    """One native call per batch element (arguments with a vmapped dim are sliced), outputs stacked
    on dim 0. Each call is the op's own kernel: results equal a Python loop bit for bit."""
    B = info.batch_size
    outs = []
    for b in range(B):
        call = [a if d is None or a is None else a.select(d, b) for a, d in zip(args, in_dims)]
        outs.append(op(*call))
    return torch.stack(outs, 0), 0


def _wsum_vmap(info: Any, in_dims: Sequence[Optional[int]], U: torch.Tensor, coef: torch.Tensor,
               base: Optional[torch.Tensor] = None, alpha: float = 1.0,
               rows: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, int]:
    dims = (tuple(in_dims) + (None,) * 5)[:5]
    return _vmap_loop(torch.ops.fedkernels.weighted_sum, info, dims, (U, coef, base, alpha, rows))


def _gram_vmap(info: Any, in_dims: Sequence[Optional[int]], U: torch.Tensor,
               rows: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, int]:
    dims = (tuple(in_dims) + (None,) * 2)[:2]
    return _vmap_loop(torch.ops.fedkernels.gram, info, dims, (U, rows))


def _register() -> None:
    torch.library.register_autograd("fedkernels::weighted_sum", _wsum_backward, setup_context=_wsum_setup)
    torch.library.register_autograd("fedkernels::gram", _gram_backward, setup_context=_gram_setup)
    torch.library.register_autograd("fedkernels::gc_project", _gc_backward, setup_context=_gc_setup)
    torch.library.register_vmap("fedkernels::weighted_sum", _wsum_vmap)
    torch.library.register_vmap("fedkernels::gram", _gram_vmap)
    for name, hint in _NO_DERIVATIVE.items():
        setup, backward = _raising(name, hint)
        torch.library.register_autograd(f"fedkernels::{name}", backward, setup_context=setup)


_register()
