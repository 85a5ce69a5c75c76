"""SCAFFOLD (Karimireddy et al., 2020), option II control variates. The control-variate maths
(client correction and delta, server tables) is ``control_variates.ControlVariateRule`` /
``control_variates.ControlVariateServer``; SCAFFOLD is its all-parameters case (FedPVR, fedpvr.py, the masked one).

Client i (``agg.client_rule()``), receiving ``{"c", "c_i"}`` from ``agg.client_payload(i)``:

    y <- y - lr * (g(y) - c_i + c)                      every local step
    delta_c_i = c_i^+ - c_i = -c + (x - y) / sum_steps lr     (option II; = (x - y)/(K lr) - c for a constant lr)

it sends ``{"delta_c": [d] tensor, "local_steps": K}``. Buffers (BatchNorm statistics) carry no
control variate. ``momentum_correction=True`` divides by the effective number of steps of SGD with
momentum (FedNova's ||a||_1) instead of K (the Kuramoto paper's SCAFFOLD baseline, [CODE]).

Server round (S = accepted clients, N = number of clients):

    x   <- x + server_lr * (1/|S|) sum_{i in S} U_i          (weighting="uniform", the paper; "samples": n_i / sum n)
    c_i <- c_i + delta_c_i   for i in S
    c   <- c + (1/N) sum_{i in S} delta_c_i                 (keeps c = mean_i c_i)

When N is unknown, N is the number of distinct clients seen so far and the c_i live in a dict. The
first round (c = c_i = 0) is FedAvg with ``server_lr``.
"""

from __future__ import annotations

from .base import register
from .control_variates import ControlVariateRule, ControlVariateServer

ScaffoldRule = ControlVariateRule


@register("scaffold")
class Scaffold(ControlVariateServer):
    """SCAFFOLD option II (see module docstring). Options: ``server_lr`` (1.0), ``weighting``
    ("uniform" default = the paper's 1/|S|; "samples" = n_k / sum n), ``momentum_correction``
    (False), ``fused_step`` (True: with a plain ``torch.optim.SGD`` the client does
    ``p -= lr * (g - c_i + c)`` with the optimizer's momentum and weight decay in one native pass),
    ``num_clients`` (N; or ``setup(num_clients=N)``), ``control_device`` (where the N x d table of the c_i
    lives, default the global model's device; "cpu": host memory), ``control_file`` (a path: the table in
    that raw file, mapped on the host; needs N). Payload per client: ``delta_c`` ([d], required)."""

    def control_layout(self, spec):
        return [e for e in spec.entries if not e.is_buffer], [(0, spec.d)], spec.d
