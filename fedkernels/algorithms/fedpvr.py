"""FedPVR (Li et al., CVPR 2023; the FedPGVC paper's baseline, spec fedpgvc §2.6): SCAFFOLD option-II
control variates on the last layers only. The control-variate maths is ``control_variates.ControlVariateRule`` /
``control_variates.ControlVariateServer`` (SCAFFOLD is its all-parameters case); FedPVR only chooses the range:

    S_c = the last ``n_ctrl`` parameterised layers (or ``ctrl_modules``; ``n_ctrl="all"``: every parameter)
    client: g_j <- g_j + (c - c_i)_j on S_c, plain SGD elsewhere;  delta_c_i = -c + (x - y)|_{S_c} / sum_steps lr
    server: w <- w + server_lr (1/|S|) sum_k U_k;  c_i += delta_c_i;  c += (1/N) sum_{i in S} delta_c_i

c and the c_i are [d_c] vectors over the controlled range (d_c = its length); clients send
``{"delta_c": [d_c], "num_steps": K}``. The [PVR] code uses momentum 0.9 off the controlled range and 0
on it; a loop wanting that builds two parameter groups.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from .base import register
from .control_variates import ControlVariateRule, ControlVariateServer, flat_ranges
from .parts import check_n_ctrl, controlled_entries

FedPVRRule = ControlVariateRule


@register("fedpvr", "scaffold_partial")
class FedPVR(ControlVariateServer):
    """FedPVR server (see module docstring). Options: ``n_ctrl`` (default 2; "all" = SCAFFOLD on every
    parameter), ``ctrl_modules`` (explicit module names), ``weighting`` ("uniform" default, or
    "samples"), ``num_clients`` (N, required here: or ``setup(num_clients=N)``), ``fused_step`` (True),
    ``momentum_correction`` (False), ``server_lr``, ``control_device`` / ``control_file`` (where the N x d_c
    table of the c_i lives: see ``control_variates.ControlVariateServer``)."""

    steps_key = "num_steps"
    require_num_clients = True

    def __init__(self, n_ctrl: Union[int, str] = 2, ctrl_modules: Optional[Sequence[str]] = None, **kw):
        super().__init__(**kw)
        check_n_ctrl(self.name, n_ctrl)
        self.n_ctrl, self.ctrl_modules = n_ctrl, ctrl_modules

    def control_layout(self, spec):
        entries = controlled_entries(spec, self.n_ctrl, self.ctrl_modules)
        return (entries,) + tuple(flat_ranges(entries))

    def layout_without_spec(self, d: int):
        if self.n_ctrl != "all":
            raise ValueError(f"{self.name}: the controlled layers need a FlatSpec (call setup(spec=...))")
        return [(0, d)], d
