"""The autograd and vmap machinery the op modules share (each op registers its own rules, beside
its wrapper, at import of fedkernels.ops).

* An op with a derivative (``weighted_sum``, ``gram``, ``gc_project``) writes its formula in its
  module (``ops/<op>.py``): ``torch.library.register_autograd`` on the raw op (torch.autograd,
  opcheck) and an ``autograd.Function`` over the same formula for the wrapper's differentiable
  path (torch.func transforms need ``setup_context``), taken when :func:`needs_grad`.
* An op without one (``min_norm``, ``lu_factor``, ``lu_solve``, ``arrowhead_solve``,
  ``fedecado_be_step``) calls :func:`no_derivative_op` in its module: a backward through it raises a
  RuntimeError naming the op (instead of torch's silent zeros / None); its wrapper ties its outputs
  to the inputs with :func:`no_derivative`. ``finite_rows`` returns bool (never differentiable); the
  in-place / out= variants are refused in the wrappers when an input requires grad.
* vmap: ``weighted_sum`` and ``gram`` batch with :func:`vmap_loop`, a loop of native calls over the
  vmapped dimension (one kernel per batch element, no K x d temporaries), instead of torch's
  per-sample fallback with a performance warning.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

# what the op wrappers return through no_derivative: one tensor or a tuple of them
Outputs = Any


# ---- ops without a derivative -------------------------------------------------------------------
_NO_DERIVATIVE: Dict[str, str] = {}  # op name -> why there is no derivative (filled by no_derivative_op)


def no_derivative_op(name: str, hint: str) -> None:
    """Registers ``fedkernels::name`` as an op without a derivative: a backward through it raises a
    RuntimeError naming the op and ``hint`` (called by the op's module, beside its wrapper)."""
    _NO_DERIVATIVE[name] = hint

    def setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        pass

    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(
            f"fedkernels.{name} has no derivative ({hint}); detach its inputs or compute it under torch.no_grad()"
        )

    torch.library.register_autograd(f"fedkernels::{name}", backward, setup_context=setup)


# ---- the wrappers' differentiable path ------------------------------------------------------------
# The raw ops carry their formulas (register_autograd, in their modules), which covers torch.autograd
# and opcheck. torch.func transforms (grad, vjp, jacrev) need an autograd.Function with setup_context,
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
        raise RuntimeError(
            f"fedkernels.{ctx.op} has no derivative ({_NO_DERIVATIVE.get(ctx.op, '')}); "
            "detach its inputs or compute it under torch.no_grad()"
        )


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
def vmap_loop(
    op: Callable[..., torch.Tensor], info: Any, in_dims: Sequence[Optional[int]], args: Sequence[Any]
) -> Tuple[torch.Tensor, int]:
    """One native call per batch element (arguments with a vmapped dim are sliced), outputs stacked
    on dim 0. Each call is the op's own kernel: results equal a Python loop bit for bit."""
    B = info.batch_size
    outs = []
    for b in range(B):
        call = [a if d is None or a is None else a.select(d, b) for a, d in zip(args, in_dims)]
        outs.append(op(*call))
    return torch.stack(outs, 0), 0
