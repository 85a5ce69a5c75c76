"""The library as a user finds it: what fedkernels.sim exports, what help(algorithms.build) lists,
and the one-line errors of algorithms.build for a bad option (method, option, value, expected type)."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from fedkernels import algorithms
from fedkernels.algorithms import Aggregator
from fedkernels.algorithms.fedavg import FedAvg


def _error(fn, *args, **kw) -> str:
    with pytest.raises(ValueError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    return msg


def test_sim_exports_simulation_lazily():
    code = (
        "import sys, fedkernels.sim as s\n"
        "assert 'fedkernels.sim.simulation' not in sys.modules, 'import fedkernels.sim loaded the round loop'\n"
        "from fedkernels.sim import Simulation, RunConfig, run\n"
        "from fedkernels.sim.simulation import Simulation as S, run as r\n"
        "from fedkernels.sim.config import RunConfig as C\n"
        "assert (Simulation, run, RunConfig) == (S, r, C)\n"
        "assert {'Simulation', 'RunConfig', 'run'} <= set(dir(s))\n"
        "try:\n    s.Nope\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "has no attribute 'Nope'" in out.stdout


def test_build_docstring_lists_every_method_and_its_options():
    doc = algorithms.build.__doc__
    for name in algorithms.available():
        assert f"``{name}``" in doc or f" {name}``" in doc or f"``{name}," in doc, name
    assert "kappa0=None" in doc and "KuramotoFedAvg" in doc  # options with defaults, the class
    assert "on_bad_update" in doc and "server_lr" in doc


def test_options_gives_types_and_defaults():
    opts = algorithms.options("Kuramoto")
    assert opts["kappa0"] == algorithms.Option("a number or None", None, False)
    assert opts["guard"].type.startswith("a bool") and opts["guard"].default is True
    assert set(opts) >= {"on_bad_update", "server_lr"}
    assert "did you mean 'kuramoto'" in _error(algorithms.options, "kuramotto")


@pytest.mark.parametrize(
    "name,opts,expect",
    [
        ("kuramoto", {"kappa0": "banana"}, "kuramoto: option kappa0='banana': expected a number or None, got str"),
        ("kuramoto", {"guard": "false"}, "kuramoto: option guard='false': expected a bool"),  # bool('false') is True
        ("fedaware", {"max_iter": 2.5}, "fedaware: option max_iter=2.5: expected an integer, got float"),
        ("fedpgvc", {"n_ctrl": 1.5}, "fedpgvc: option n_ctrl=1.5: expected an integer or a string"),
        ("fedavg", {"server_lr": [1.0]}, "fedavg: option server_lr=[1.0]: expected a number, got list"),
        ("gcfed", {"global_layers": "fc"}, "gcfed: option global_layers='fc': expected a list"),
        (
            "fedavg",
            {"server_lr": torch.ones(2, 2)},  # a printed tensor, on one line
            "fedavg: option server_lr=tensor([[1., 1.], [1., 1.]]): expected a number, got Tensor",
        ),
    ],
)
def test_build_names_method_option_value_and_type(name, opts, expect):
    assert _error(algorithms.build, name, **opts).startswith(expect)
    # the class itself, constructed directly, says the same
    cls = algorithms.base._REGISTRY[name]
    assert _error(cls, **opts).startswith(expect.replace(f"{name}:", f"{cls.name}:", 1))


def test_unknown_option_lists_the_valid_ones_with_a_suggestion():
    for make in (lambda: algorithms.build("fedavg", server_lrr=1), lambda: FedAvg(server_lrr=1)):
        msg = _error(make)
        assert msg == (
            "fedavg: unknown option server_lrr=1; did you mean 'server_lr'? "
            "options: weighting, server_lr_schedule, on_bad_update, server_lr"
        )
    assert "did you mean 'fedavg'" in _error(algorithms.build, "fedavgg")


def test_build_converts_number_text_and_numpy_numbers():
    assert algorithms.build("kuramoto", kappa0="0.25").kappa0 == 0.25
    agg = algorithms.build("fedaware", max_iter=np.int64(7), tol=np.float32(1e-4))
    assert type(agg.max_iter) is int and agg.max_iter == 7
    assert algorithms.build("fedavg", server_lr=np.float64(0.5)).server_lr == 0.5


def test_a_required_option_is_named():
    class Needs(Aggregator):
        def __init__(self, alpha: float, **kw):
            super().__init__(**kw)
            self.alpha = alpha

        def _aggregate(self, rin):
            raise NotImplementedError

    algorithms.base._REGISTRY["_test_needs"] = Needs
    try:
        assert _error(algorithms.build, "_test_needs").startswith("_test_needs: option alpha is required (a number)")
        assert algorithms.build("_test_needs", alpha="2").alpha == 2.0
    finally:
        del algorithms.base._REGISTRY["_test_needs"]


def test_aggregate_docstring_documents_arguments_and_result():
    doc = Aggregator.aggregate.__doc__
    for word in (
        "global_flat",
        "updates",
        "num_examples",
        "client_ids",
        "payloads",
        "[K, d]",
        "AggResult(params, info)",
        "BadUpdateError",
        "device",
        "dtype",
    ):
        assert word in doc, word
    # what it says about the result holds: a new tensor of global_flat's dtype, num_clients in info
    g = torch.zeros(5, dtype=torch.float64)
    res = algorithms.build("fedavg").aggregate(g, torch.ones(3, 5, dtype=torch.float64), [1, 1, 2])
    assert res.params.data_ptr() != g.data_ptr() and res.params.dtype == g.dtype
    assert res.info["num_clients"] == 3


def test_fedecado_flat_stepping_options_are_typed():
    # L, T_bar, dt0 ... are Stepping fields that FedECADO also takes flat: their types come along
    assert algorithms.options("fedecado")["L"].type == "a number or None"
    assert _error(algorithms.build, "fedecado", T_bar="banana").startswith(
        "fedecado: option T_bar='banana': expected a number or None"
    )
    assert algorithms.build("fedecado", L="2.5").stepping.L == 2.5


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf")])
def test_server_lr_out_of_range_is_one_line(bad):
    # the library refuses what the CLI's range refuses (server_lr > 0), naming the method and the value
    with pytest.raises(ValueError, match=r"^fedavg: server_lr must be a finite number > 0, got "):
        algorithms.build("fedavg", server_lr=bad)
