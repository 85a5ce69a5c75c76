"""The fused adaptive server-optimiser step: ``server_opt_step_`` (FedAdam / FedYogi / FedAdagrad).

One native pass over d (``csrc/cpu/server_opt_step.cpp``, ``csrc/cuda/server_opt_step.cu``, the
per-coordinate maths shared in ``csrc/cuda/server_opt_step.cuh``); float64 oracle:
``fedkernels.reference.server_opt_step_``. In place, no derivative (a server step runs under
``torch.no_grad``).
"""

from __future__ import annotations

import torch

from ._checks import _finite_number, _needs_kernel, _no_grad_through, _same_storage, _tensor, tracing

__all__ = ["server_opt_step_", "SERVER_OPT_RULES"]

SERVER_OPT_RULES = ("adam", "yogi", "adagrad")


def server_opt_step_(
    io: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    *,
    rule: str,
    lr: float,
    beta_1: float = 0.0,
    beta_2: float = 0.0,
    tau: float = 1e-9,
    from_model: bool = False,
) -> torch.Tensor:
    """One adaptive server-optimiser step (Reddi et al. 2021, Algorithm 2, as Flower writes it), in
    place, one pass over the d coordinates::

        g   = io                    (from_model=True: io - x, io holding an inner method's new model)
        m   = beta_1 m + (1 - beta_1) g
        v   = beta_2 v + (1 - beta_2) g^2             rule="adam"
              v - (1 - beta_2) g^2 sign(v - g^2)      rule="yogi"
              v + g^2                                 rule="adagrad"
        io  = x + lr m / (sqrt(v) + tau)

    ``io``: [d], the pseudo-gradient (aggregate - x) on entry and the new model on return, dtype and
    device of ``x`` ([d], the current global model; read only). ``m``, ``v``: [d] optimiser state,
    float32 (any model dtype) or float64 (required for a float64 model), one dtype, updated in place.
    ``lr``: the step size (the caller folds in any bias correction, e.g. Flower's FedAdam
    ``eta * sqrt(1 - beta_2^t) / (1 - beta_1^t)``). Arithmetic in the state's precision with explicit
    fmas and correctly rounded sqrt/division: the same bits for any thread count, on either backend.
    NaN/Inf in the inputs propagate. Non-contiguous tensors are accepted (the mutated ones go through
    a contiguous copy written back). Returns ``io``.
    """
    op = "server_opt_step_"
    io, m, v, x = (_tensor(t, op, n) for t, n in ((io, "io"), (m, "m"), (v, "v"), (x, "x")))
    if rule not in SERVER_OPT_RULES:
        raise ValueError(f"{op}: rule must be one of {SERVER_OPT_RULES}, got {rule!r}")
    lr = _finite_number(lr, op, "lr")
    tau = _finite_number(tau, op, "tau")
    if tau < 0:
        raise ValueError(f"{op}: tau must be >= 0, got {tau}")
    for name, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
        if not 0.0 <= _finite_number(beta, op, name) <= 1.0:
            raise ValueError(f"{op}: {name} must lie in [0, 1], got {beta}")
    if not isinstance(from_model, bool):
        raise ValueError(f"{op}: from_model must be a bool, got {from_model!r}")
    # (shapes, dtypes, devices and layouts: the native op checks them, csrc/server_opt_step_checks.h)
    named = (("io", io), ("m", m), ("v", v), ("x", x))
    for i, (na, ta) in enumerate(named):
        for nb, tb in named[i + 1 :]:
            if _same_storage(ta, tb):
                raise ValueError(
                    f"{op}: {na} and {nb} share memory; pass separate tensors (io, m and v are written while x is read)"
                )
    if not tracing():
        for name, t in named[:3]:
            if t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:  # 1 = MemOverlap::Yes
                raise ValueError(
                    f"{op}: {name} has internally overlapping memory (e.g. from expand()) and "
                    "cannot be written in place; clone() it first"
                )
    _needs_kernel(op, x.device, op)
    _no_grad_through(op, io, m, v, x)
    work = [t if t.is_contiguous() else t.contiguous() for t in (io, m, v)]
    torch.ops.fedkernels.server_opt_step_(
        work[0], work[1], work[2], x.contiguous(), rule, lr, float(beta_1), float(beta_2), tau, from_model
    )
    for dst, src in zip((io, m, v), work):
        if dst is not src:
            dst.copy_(src)
    return io


@torch.library.register_fake("fedkernels::server_opt_step_")
def _server_opt_step_fake(
    io: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    rule: str,
    lr: float,
    beta_1: float,
    beta_2: float,
    tau: float,
    from_model: bool = False,
) -> None:
    return None
