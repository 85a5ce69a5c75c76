"""FedPGVC's update modes (spec fedpgvc.md §2.4): the direction u on the controlled layers, and the
released script's post-training shrink (``mode="code"``). The rule that drives them is in __init__.py.

``code`` follows ``FedPGVC.py`` of github.com/Pranabiitp/FedPGVC (spec §2.4 [CODE]). After plain local
training, with the per-sample losses l_s of the *whole* local set (stored order) at the local model
and G_t = grad of sum_s l_s for the t-th trainable tensor in Keras order ([W1, b1, W2, b2, ...]):

    r_t = l_t * mean(G_t)                      t < min(n, T)  (``zip(batch_loss, batch_grad)``)
    W <- (1 - eta * r_j) W                     for every tensor W of a controlled Keras layer j

where j is the layer's index in the Keras ``model.layers`` list, which counts the parameter-free
layers (pooling, Flatten) too. So r_j belongs to a *different* tensor: on the script's CNN
[Conv, Pool, Conv, Pool, Flatten, Dense120, Dense84, Dense-out] the output layer (j = 7) is scaled by
r_7, the Dense84 bias's. The Keras list of a model is ``code_layers`` (aggregator option) or the
model's ``keras_layers`` attribute (the models of fedkernels.sim.models declare theirs): the names of
the parameterised modules in Keras order, any other string standing for a parameter-free layer.
A model with neither gets a ValueError (the mapping cannot be guessed from a torch module).

Named deviations from the script: the loss is the rule's ``loss_fn`` (log-softmax cross-entropy;
Keras clips softmax probabilities to [1e-7, 1 - 1e-7]); the pass runs in eval mode (Keras'
``model(x)`` default) in chunks whose gradients are summed (the same G up to rounding); a client with
j >= min(n, T) gets a ValueError where the script raises IndexError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

PGVC_MODES = ("hadamard", "additive", "layer_scalar", "layer_normalize", "code", "lr_matched")


def pgvc_direction_(
    grads: List[torch.Tensor],
    rhos: Optional[List[torch.Tensor]],
    mode: str,
    lam: float = 1.0,
    stat: str = "mean",
    tau: float = 1.0,
) -> List[torch.Tensor]:
    """Overwrites each g in ``grads`` with the FedPGVC direction u (spec §2.4); returns grads."""
    if not grads:
        return grads
    if mode == "hadamard":
        torch._foreach_mul_(grads, rhos)
    elif mode == "additive":
        torch._foreach_add_(grads, rhos, alpha=lam)
    elif mode == "layer_scalar":
        s = [r.mean() for r in rhos] if stat == "mean" else list(torch._foreach_norm(rhos))
        torch._foreach_mul_(grads, s)
    elif mode == "layer_normalize":
        norms = torch._foreach_norm(grads)
        # a zero gradient stays zero (no direction to normalise)
        s = [torch.where(n > 0, tau / n.clamp_min(torch.finfo(n.dtype).tiny), torch.zeros_like(n)) for n in norms]
        torch._foreach_mul_(grads, s)
    elif mode != "code":
        raise ValueError(f"unknown FedPGVC mode {mode!r}")
    return grads


@dataclass
class CodePlan:
    """Where the script's r comes from for each controlled tensor (built once per client)."""

    tensors: List[torch.Tensor]  # the controlled tensors, shrunk in place
    sources: List[torch.Tensor]  # Keras tensor j (whose gradient mean enters r_j), one per distinct j
    js: torch.Tensor  # [len(sources)] the distinct Keras layer indices j
    owner: torch.Tensor  # [len(tensors)] position in ``js`` of each controlled tensor's layer


def code_plan(model, spec, ctrl_entries, code_layers: Optional[Sequence[str]] = None) -> CodePlan:
    """Maps the controlled tensors to the script's Keras layer index j and tensor j (module doc)."""
    layers = list(code_layers) if code_layers is not None else getattr(model, "keras_layers", None)
    if layers is None:
        raise ValueError(
            f"FedPGVC mode 'code': the Keras layer list of {type(model).__name__} is unknown (the "
            "script indexes r by Keras model.layers, pooling and Flatten included); pass "
            "code_layers=[...] (module names in Keras order, other names = parameter-free layers) "
            "or give the model a keras_layers attribute"
        )
    layers = list(layers)
    mods = spec.layer_modules()
    bad = [m for m in mods if layers.count(m) != 1]
    if bad:
        raise ValueError(
            f"FedPGVC mode 'code': code_layers must list every parameterised module exactly once; "
            f"{bad} are missing or repeated in {layers} (modules: {mods})"
        )
    params = dict(model.named_parameters())
    by_mod = {m: [params[e.name] for e in spec.entries if not e.is_buffer and e.module == m] for m in mods}
    keras_tensors = [p for name in layers for p in by_mod.get(name, [])]
    j_of = {name: j for j, name in enumerate(layers)}
    js = [j_of[e.module] for e in ctrl_entries]
    if js and max(js) >= len(keras_tensors):
        raise ValueError(
            f"FedPGVC mode 'code': Keras layer index {max(js)} has no tensor {max(js)} "
            f"(the model has {len(keras_tensors)}; the script raises IndexError here)"
        )
    uniq = sorted(set(js))
    return CodePlan(
        tensors=[params[e.name] for e in ctrl_entries],
        sources=[keras_tensors[j] for j in uniq],
        js=torch.tensor(uniq, dtype=torch.long),
        owner=torch.tensor([uniq.index(j) for j in js], dtype=torch.long),
    )


def code_r(model, loss_fn, local_data: Iterable[Tuple[torch.Tensor, torch.Tensor]], plan: CodePlan) -> torch.Tensor:
    """r_j = l_j * mean(G_j) for the plan's distinct j, from one pass over ``local_data`` (the whole
    local set as (x, y) chunks in stored order): a [len(plan.js)] tensor, no host sync."""
    was = model.training
    model.eval()
    try:
        G, losses = None, []
        for x, y in local_data:
            ell = loss_fn(model(x), y)
            gs = torch.autograd.grad(ell.sum(), plan.sources, materialize_grads=True)
            if G is None:
                G = list(gs)
            else:
                torch._foreach_add_(G, gs)
            losses.append(ell.detach())
    finally:
        model.train(was)
    n = sum(int(l.numel()) for l in losses)
    if n <= int(plan.js.max()):
        raise ValueError(
            f"FedPGVC mode 'code': the client has {n} local samples but Keras layer "
            f"{int(plan.js.max())} needs sample {int(plan.js.max())} (the script's rho_i[j] "
            "raises IndexError when j >= min(n, number of tensors))"
        )
    ell = torch.cat(losses)
    means = torch.stack([g.mean() for g in G])
    return ell[plan.js.to(ell.device)] * means.to(ell.dtype)


def code_shrink_(tensors: List[torch.Tensor], r, eta: float, owner: Optional[torch.Tensor] = None) -> None:
    """The script's post-training step (spec §2.4 [CODE], U8): W <- (1 - eta r) W, with tensor i
    taking r[owner[i]] (owner None: r[i]). ``r``: a tensor, or a sequence of floats."""
    if not tensors:
        return
    r = torch.as_tensor(r, dtype=tensors[0].dtype, device=tensors[0].device)
    f = 1.0 - eta * (r if owner is None else r[owner.to(r.device)])
    with torch.no_grad():
        torch._foreach_mul_(tensors, list(f.unbind()))
