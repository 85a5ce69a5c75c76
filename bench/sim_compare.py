"""Whole-simulation speed, side by side: fedkernels (workers=1, workers=2), a plain PyTorch loop,
Flower's simulation engine and pfl-research, on the same data, partition, client sampling, initial
weights and hyper-parameters.

    python -m bench.sim_compare                      # both tasks, every runner that is installed
    python -m bench.sim_compare --tasks demo --runners fedkernels-w1,fedkernels-w2,plain
    PEERS=.peers-venv/bin/python python -m bench.sim_compare   # the peers from their own venv
    make bench-sim                                   # installs the peers into .peers-venv first

Tasks (Fashion-MNIST, the simulator's small_cnn (18,378 parameters), SGD lr 0.05, batch 16, one
local epoch, FedAvg weighted by sample counts, test accuracy on 2,000 test images every round):

* ``demo``: 12,000 training images, 10 clients x 2 label shards, all clients every round, 5 rounds.
* ``cross-device``: 60,000 training images, 1,000 clients by Dirichlet(0.3) over labels, 50 clients
  drawn per round (``fedkernels.sim.simulation.sample_schedule``), 20 rounds (``--cd-rounds``).

Every runner is a fresh process (``--run RUNNER --task TASK``): the parent records its launch time
and samples the proportional set size (PSS: shared pages counted once) of the process tree every
500 ms for the peak memory. The runner reports per round its wall time and the split it can see
(local training incl. transport, aggregation, evaluation), the start-up (launch -> first round
starts: imports, data, partition, model, worker/engine start) and the final accuracy. Data,
partition, schedule and initial model come from fedkernels' own functions in every runner
(``common_setup``), so the inputs are identical; each client's batches are drawn from
``client_seed(seed, round, client_id)`` in fedkernels and the plain loop (so those two match
closely), the peers use their own data pipelines with the same batch size and epochs.

Sampling: every runner trains the clients of fedkernels' pre-drawn schedule in each round. pfl
draws users from an iterator over the schedule; Flower's strategy sends each round's messages to the
supernodes whose ``partition-id`` is scheduled (the node-id -> partition-id map its simulation
builds; every reply names its partition and a round whose replies differ from the schedule stops
the run), ``FLOWER_SAMPLING=flower`` for Flower's own uniform sampling instead.

Load: the machine may be shared. Every row records ``os.getloadavg()`` at its start and end;
``--repeat N`` runs fedkernels workers=1, workers=2 and the plain loop N times interleaved (w1, w2,
plain, w1, ...) and the ratios are taken within each cycle, then their median (``ratios`` in the
JSON). A runner that hits its time limit (``--timeout``; ``--flower-timeout`` for Flower, whose
Ray start-up and first round with 1,000 supernodes are slow) still reports how far it got: rounds
done and their times (it prints a ``PROGRESS`` line per round on stderr).

Writes sim-compare.json (``--out``; bench/common.py) and prints a Markdown table with ratios to the
fedkernels workers=1 run and to the plain loop.

Executor mode: ``--executors [--device cpu|cuda] [--presets a,b] [--rounds R] [--repeat N]
[--chunk round|auto|N]`` runs fedkernels itself on presets (default: the MLP presets whose data are
bundled) with the sequential executor (``clients_at_once=off``) and the batched one (chunks of the
whole round by default), interleaved N times in one process, and reports the median local-training
time per round (round 1, the warm-up, left out), the ratio, the largest difference of the final
global models, the evaluation time of the last round (``sim/evaluate.py``) and the batched executor's
working memory per client (``client_bytes``, with the activations it measured). Besides presets it
runs the named cases of ``EXECUTOR_CASES`` (a preset with overrides: ``kuramoto-digits-bn``, a
BatchNorm ResNet-18 of width 8, whose running statistics the batched executor carries per client).
Writes bench/results/sim-executors-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASKS: Dict[str, Dict[str, Any]] = {
    "demo": {
        "train": 12000,
        "test": 2000,
        "clients": 10,
        "scheme": "shards",
        "popts": {"shards_per_client": 2},
        "per_round": 10,
        "rounds": 5,
    },
    "cross-device": {
        "train": None,
        "test": 2000,
        "clients": 1000,
        "scheme": "dirichlet",
        "popts": {"alpha": 0.3},
        "per_round": 50,
        "rounds": 20,
    },
}
HP = {"batch": 16, "lr": 0.05, "epochs": 1, "seed": 0, "model": "small_cnn", "eval_batch": 1024}
RUNNERS = ["fedkernels-w1", "fedkernels-w2", "fedkernels-w1-1thread", "plain", "flower", "pfl"]


def _now() -> float:
    return time.time()


# ================================================================================================
# shared set-up: identical inputs for every runner
# ================================================================================================
def common_setup(task: str):
    """(train x, y, test x, y, client index arrays, schedule, initial model) exactly as the
    simulator builds them for the task's config."""
    import numpy as np
    import torch
    from fedkernels.sim.seeds import derive_seed, STREAM_INIT
    from fedkernels.sim.data import load_dataset
    from fedkernels.sim.models import build_model
    from fedkernels.sim.partition import partition
    from fedkernels.sim.simulation import sample_schedule

    t = TASKS[task]
    tr, te = load_dataset("fmnist", max_train=t["train"], max_test=t["test"])
    parts = partition(tr.y.numpy(), t["clients"], t["scheme"], HP["seed"], **t["popts"])
    parts = [torch.as_tensor(np.asarray(p), dtype=torch.long) for p in parts]
    sched = sample_schedule(HP["seed"], t["clients"], t["per_round"], t["rounds"])
    torch.manual_seed(derive_seed(HP["seed"], STREAM_INIT))
    model = build_model(HP["model"], 10, 1, 28)
    return tr.x, tr.y, te.x, te.y, parts, sched, model


_SETUP: Dict[str, Any] = {}


def cached_setup(task: str):
    """common_setup once per process (Flower's client actors load the data themselves, as its
    tutorials do, instead of receiving it pickled in the app's closure)."""
    if task not in _SETUP:
        _SETUP[task] = common_setup(task)
    return _SETUP[task]


def fk_config(task: str, workers: int, threads: Optional[int] = None):
    from fedkernels.sim.config import RunConfig

    t = TASKS[task]
    return RunConfig.from_dict(
        {
            "name": f"bench-{task}-w{workers}",
            "seed": HP["seed"],
            "rounds": t["rounds"],
            "num_clients": t["clients"],
            "clients_per_round": t["per_round"],
            "eval_every": 1,
            "client_loss": "none",
            "workers": workers,
            "threads": threads,
            "eval_batch_size": HP["eval_batch"],
            "plots": False,
            "verbose": False,
            "progress": False,
            "data": {"name": "fmnist", "train_subset": t["train"], "test_subset": t["test"]},
            "partition": {"scheme": t["scheme"], "options": dict(t["popts"])},
            "model": {"name": HP["model"]},
            "train": {"epochs": HP["epochs"], "batch_size": HP["batch"], "lr": HP["lr"]},
            "algorithm": {"name": "fedavg"},
        }
    )


# ================================================================================================
# runners (each in its own process; print one RESULT line)
# ================================================================================================
def run_fedkernels(task: str, workers: int, threads: Optional[int] = None) -> Dict[str, Any]:
    from fedkernels.sim.simulation import Simulation

    sim = Simulation(fk_config(task, workers, threads), write_outputs=False)
    rounds: List[Dict[str, Any]] = []
    first = []
    orig = sim.run_round

    def timed(r):
        t0 = _now()
        if not first:
            first.append(t0)
        m = orig(r)
        rounds.append(
            {
                "round": r + 1,
                "t": _now() - t0,
                "t_local": m["t_local"],
                "t_agg": m["t_agg"],
                "t_eval": m.get("t_eval", 0.0),
                "accuracy": m.get("accuracy"),
            }
        )
        return m

    sim.run_round = timed
    s = sim.run()
    out = {
        "first_round_start": first[0],
        "rounds": rounds,
        "final_accuracy": s.get("final_accuracy"),
        "threads_per_process": None,
        "d": sim.spec.d,
    }
    from fedkernels.sim.workers import default_threads
    import torch

    out["threads_per_process"] = (
        default_threads(workers, threads) if workers > 1 else (threads or torch.get_num_threads())
    )
    return out


def _fk_eval(model, x, y):
    from fedkernels.sim.evaluate import evaluate

    return evaluate(model, x, y, HP["eval_batch"])[0]


def run_plain(task: str) -> Dict[str, Any]:
    """The sequential floor: one model, the round's clients one after another, FedAvg of state dicts."""
    import torch
    from fedkernels.sim.seeds import client_seed

    x, y, xt, yt, parts, sched, model = common_setup(task)
    B, lr = HP["batch"], HP["lr"]
    glob = [p.detach().clone() for p in model.parameters()]
    crit = torch.nn.CrossEntropyLoss()
    rounds, first = [], _now()
    for r, ids in enumerate(sched):
        t0 = _now()
        acc_sum = [torch.zeros_like(p) for p in glob]
        tot = 0.0
        for cid in ids:
            with torch.no_grad():
                for p, g in zip(model.parameters(), glob):
                    p.copy_(g)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            gen = torch.Generator().manual_seed(client_seed(HP["seed"], r, cid))
            idx = parts[cid]
            n = idx.numel()
            for _ in range(HP["epochs"]):
                perm = idx[torch.randperm(n, generator=gen)]
                for s in range(0, n, B):
                    b = perm[s : s + B]
                    opt.zero_grad(set_to_none=True)
                    crit(model(x[b]), y[b]).backward()
                    opt.step()
            with torch.no_grad():
                for a, p in zip(acc_sum, model.parameters()):
                    a.add_(p, alpha=float(n))
            tot += n
        t1 = _now()
        with torch.no_grad():
            for g, a in zip(glob, acc_sum):
                g.copy_(a / tot)
        t2 = _now()
        with torch.no_grad():
            for p, g in zip(model.parameters(), glob):
                p.copy_(g)
        acc = _fk_eval(model, xt, yt)
        t3 = _now()
        rounds.append(
            {"round": r + 1, "t": t3 - t0, "t_local": t1 - t0, "t_agg": t2 - t1, "t_eval": t3 - t2, "accuracy": acc}
        )
    import torch as _t

    return {
        "first_round_start": first,
        "rounds": rounds,
        "final_accuracy": rounds[-1]["accuracy"],
        "threads_per_process": _t.get_num_threads(),
    }


def _progress(state: Dict[str, Any]) -> None:
    """A runner's partial result so far, on stderr (the parent keeps the last one if the runner
    is stopped at its time limit: how far it got)."""
    print(
        "PROGRESS "
        + json.dumps({"first_round_start": state.get("first"), "rounds": state["rounds"], **state.get("extra", {})}),
        file=sys.stderr,
        flush=True,
    )


def run_flower(task: str) -> Dict[str, Any]:
    """Flower's simulation engine (Ray backend, Message API): a ClientApp per partition (node
    ``partition-id``), FedAvg with centralised evaluation; 1 CPU per client, 1 thread per actor.

    Sampling: ``FLOWER_SAMPLING=schedule`` (default) sends each round's messages to the nodes whose
    ``partition-id`` is in fedkernels' pre-drawn schedule (the node-id -> partition-id map Flower's
    simulation builds when it registers the nodes; every reply says which partition trained and the
    round stops if they differ); ``FLOWER_SAMPLING=flower`` uses Flower's own uniform sampling."""
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from fedkernels.sim.seeds import client_seed

    t = TASKS[task]
    rounds_env = os.environ.get("BENCH_CD_ROUNDS")
    sampling = os.environ.get("FLOWER_SAMPLING", "schedule")
    xt, yt, model0 = None, None, None
    state: Dict[str, Any] = {
        "first": None,
        "rounds": [],
        "last": None,
        "agg": 0.0,
        "sent": None,
        "extra": {"sampling": sampling},
    }
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        if rounds_env:
            TASKS["cross-device"]["rounds"] = int(rounds_env)
        x, y, _, _, parts, _, model0 = cached_setup(task)
        cid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"]) - 1
        model = model0
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=HP["lr"])
        gen = torch.Generator().manual_seed(client_seed(HP["seed"], rnd, cid))
        idx = parts[cid]
        n = idx.numel()
        crit = torch.nn.CrossEntropyLoss()
        model.train()
        for _ in range(HP["epochs"]):
            perm = idx[torch.randperm(n, generator=gen)]
            for s in range(0, n, HP["batch"]):
                b = perm[s : s + HP["batch"]]
                opt.zero_grad(set_to_none=True)
                crit(model(x[b]), y[b]).backward()
                opt.step()
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord(model.state_dict()),
                    "metrics": MetricRecord({"num-examples": n, "partition-id": cid}),
                }
            ),
            reply_to=msg,
        )

    # node id -> partition id, as Flower's simulation registers the supernodes (same process)
    import flwr.server.superlink.fleet.vce.vce_api as vce_api

    node_of: Dict[int, int] = {}
    register = vce_api._register_nodes

    def _register(num_nodes, state_factory):
        mapping = register(num_nodes, state_factory)
        node_of.update({int(p): int(nid) for nid, p in mapping.items()})
        return mapping

    vce_api._register_nodes = _register
    sched = cached_setup(task)[5]

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            state["sent"] = _now()
            if sampling != "schedule" or t["per_round"] >= t["clients"]:
                return super().configure_train(server_round, arrays, config, grid)
            deadline = time.monotonic() + 120
            while len(node_of) < t["clients"] and time.monotonic() < deadline:
                time.sleep(0.05)
            config["server-round"] = server_round
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
            ids = sched[server_round - 1]
            return self._construct_messages(record, [node_of[c] for c in ids], MessageType.TRAIN)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            a = _now()
            state["first_reply_wait"] = a - state["sent"]
            if sampling == "schedule" and t["per_round"] < t["clients"]:
                got = sorted(int(m.content["metrics"]["partition-id"]) for m in replies if not m.has_error())
                if got != sorted(sched[server_round - 1]):
                    raise RuntimeError(
                        f"round {server_round}: replies from partitions {got[:5]}..., "
                        f"expected the schedule's {sched[server_round - 1][:5]}..."
                    )
            out = super().aggregate_train(server_round, replies)
            state["agg"] += _now() - a
            return out

    def central_eval(server_round: int, arrays: ArrayRecord):
        te = _now()
        _, _, xt, yt, _, _, model0 = cached_setup(task)
        if server_round == 0:
            state["first"] = te
        m = model0
        m.load_state_dict(arrays.to_torch_state_dict())
        acc = _fk_eval(m, xt, yt)
        end = _now()
        if server_round > 0:
            start = state["last"]
            state["rounds"].append(
                {
                    "round": server_round,
                    "t": end - start,
                    "t_local": te - start - state["agg"],
                    "t_agg": state["agg"],
                    "t_eval": end - te,
                    "accuracy": acc,
                }
            )
            _progress(state)
        state["agg"] = 0.0
        state["last"] = end
        return MetricRecord({"accuracy": acc})

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        frac = t["per_round"] / t["clients"]
        strategy = TimedFedAvg(
            fraction_train=frac, fraction_evaluate=0.0, min_train_nodes=t["per_round"], min_available_nodes=t["clients"]
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(cached_setup(task)[6].state_dict()),
            num_rounds=t["rounds"],
            evaluate_fn=central_eval,
        )

    ncpu = len(os.sched_getaffinity(0))
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=t["clients"],
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": ncpu, "include_dashboard": False, "logging_level": "error"},
        },
    )
    del np, xt, yt, model0
    return {
        "first_round_start": state["first"],
        "rounds": state["rounds"],
        "final_accuracy": state["rounds"][-1]["accuracy"] if state["rounds"] else None,
        "threads_per_process": 1,
        "sampling": (
            "all"
            if t["per_round"] >= t["clients"]
            else "fedkernels' schedule (node-id -> partition-id map)"
            if sampling == "schedule"
            else "Flower's own (uniform)"
        ),
    }


def _bench_threads() -> Optional[int]:
    v = os.environ.get("BENCH_THREADS")
    return int(v) if v else None


RUN = {
    "fedkernels-w1": lambda task: run_fedkernels(task, 1, _bench_threads()),
    "fedkernels-w2": lambda task: run_fedkernels(task, 2),
    "fedkernels-w1-1thread": lambda task: run_fedkernels(task, 1, 1),
    "plain": run_plain,
    "flower": run_flower,
}


def run_pfl(task: str) -> Dict[str, Any]:
    """pfl-research's simulation (PyTorch backend, SimulatedBackend, FederatedAveraging weighted by
    data points, central lr 1), users drawn in the schedule's order, evaluation by a callback."""
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    t = TASKS[task]
    x, y, xt, yt, parts, sched, net = common_setup(task)

    class Net(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.crit = torch.nn.CrossEntropyLoss()

        def forward(self, xb):
            return self.inner(xb)

        def loss(self, xb, yb, eval=False):
            self.eval() if eval else self.train()
            return self.crit(self(xb), yb)

        @torch.no_grad()
        def metrics(self, xb, yb, eval=False):
            self.eval() if eval else self.train()
            out = self(xb)
            n = len(yb)
            return {
                "loss": Weighted(float(self.crit(out, yb)) * n, n),
                "accuracy": Weighted(float((out.argmax(1) == yb).sum()), n),
            }

    module = Net(net)
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    order = iter([c for ids in sched for c in ids])

    def make_dataset_fn(uid):
        idx = parts[uid]
        return Dataset(raw_data=[x[idx], y[idx]], user_id=uid)

    train_data = FederatedDataset(
        make_dataset_fn, lambda: next(order), user_id_to_weight={i: int(p.numel()) for i, p in enumerate(parts)}
    )
    backend = SimulatedBackend(training_data=train_data, val_data=None, postprocessors=[WeightByDatapoints()])
    state = {"first": None, "last": None, "rounds": []}

    class Timing(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            state["first"] = state["last"] = _now()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            te = _now()
            acc = _fk_eval(module.inner, xt, yt)
            end = _now()
            state["rounds"].append(
                {
                    "round": central_iteration + 1,
                    "t": end - state["last"],
                    "t_local": te - state["last"],
                    "t_agg": 0.0,
                    "t_eval": end - te,
                    "accuracy": acc,
                }
            )
            state["last"] = end
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=t["rounds"],
            evaluation_frequency=10**6,
            train_cohort_size=t["per_round"],
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=HP["lr"], local_num_epochs=HP["epochs"], local_batch_size=HP["batch"]
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=HP["eval_batch"]),
        callbacks=[Timing()],
    )
    return {
        "first_round_start": state["first"],
        "rounds": state["rounds"],
        "final_accuracy": state["rounds"][-1]["accuracy"],
        "threads_per_process": torch.get_num_threads(),
        "split_note": "t_local includes pfl's aggregation (not separable from outside)",
    }


RUN["pfl"] = run_pfl


# ================================================================================================
# the parent: launch, watch memory, summarise
# ================================================================================================
def _children(pid: int) -> List[int]:
    out: List[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def _tree_pss_kib(pid: int) -> int:
    """PSS of ``pid`` and all its descendants (KiB), walking /proc/PID/task/TID/children."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(_children(p))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total


def launch(runner: str, task: str, python: str, timeout: float) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = _now()
    p = subprocess.Popen(
        [python, "-m", "bench.sim_compare", "--run", runner, "--task", task],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_pss_kib(p.pid))
            stop.wait(0.5)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    load0 = loadavg()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        stop.set()
        row = {
            "runner": runner,
            "task": task,
            "error": f"timed out after {timeout:.0f}s",
            "loadavg_start": load0,
            "loadavg_end": loadavg(),
            "peak_pss_mib": round(peak[0] / 1024, 1),
        }
        prog = [ln for ln in err.splitlines() if ln.startswith("PROGRESS ")]
        if prog:  # how far it got
            got = json.loads(prog[-1][9:])
            ts = [r["t"] for r in got["rounds"]]
            row.update(
                rounds_run=len(ts),
                per_round_s=ts,
                startup_s=(got["first_round_start"] - t0) if got.get("first_round_start") else None,
                accuracy_at_stop=got["rounds"][-1]["accuracy"] if got["rounds"] else None,
                **({"round_median_s": statistics.median(ts[1:])} if len(ts) > 1 else {}),
            )
        return row
    finally:
        stop.set()
        th.join()
    t_end = _now()
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {
            "runner": runner,
            "task": task,
            "error": f"exit {p.returncode}: {err.strip()[-600:]}",
            "loadavg_start": load0,
            "loadavg_end": loadavg(),
        }
    res = json.loads(line[-1][7:])
    rounds = res.pop("rounds")
    ts = [r["t"] for r in rounds]
    after = ts[1:] or ts
    split = {k: statistics.median([r[k] for r in rounds[1:] or rounds]) for k in ("t_local", "t_agg", "t_eval")}
    return {
        "runner": runner,
        "task": task,
        "rounds_run": len(rounds),
        "round_median_s": statistics.median(after),
        "round_min_s": min(after),
        "round_max_s": max(after),
        "round1_s": ts[0],
        "startup_s": res["first_round_start"] - t0,
        "total_s": t_end - t0,
        "median_split_s": split,
        "peak_pss_mib": round(peak[0] / 1024, 1),
        "final_accuracy": res.get("final_accuracy"),
        "per_round_s": ts,
        "loadavg_start": load0,
        "loadavg_end": loadavg(),
        **{k: v for k, v in res.items() if k not in ("first_round_start", "final_accuracy")},
    }


def loadavg() -> List[float]:
    return [float(v) for v in open("/proc/loadavg").read().split()[:3]]


EXECUTOR_CASES: Dict[str, Any] = {  # name: (preset, overrides)
    "kuramoto-digits-bn": (
        "kuramoto-digits",
        ["model.options={}", "model.name=resnet18_gn", "model.options.norm=bn", "model.options.width=8"],
    ),
}
EXECUTOR_PRESETS = "smoke,kuramoto-digits,fedpgvc-digits,fedaware-digits,kuramoto-digits-bn"


def executors(
    presets_: str, device: str, rounds: int, repeat: int, chunk: str, threads: Optional[int], out: str
) -> int:
    """Sequential vs batched local training of fedkernels on the same presets (see module docstring)."""
    import platform
    import torch
    from fedkernels.sim import presets as P
    from fedkernels.sim.config import apply_overrides
    from fedkernels.sim.data import DatasetNotFoundError
    from fedkernels.sim.simulation import Simulation

    rows = []
    for name in presets_.split(","):
        preset, extra = EXECUTOR_CASES.get(name, (name, []))
        per_round = P.get(preset).per_round()
        batched = per_round if chunk == "round" else chunk
        res: Dict[str, List[float]] = {"off": [], "batched": []}
        t_eval: Dict[str, List[float]] = {"off": [], "batched": []}
        final: Dict[str, Any] = {}
        memory = None
        try:
            for rep in range(max(1, repeat)):
                for ex in ("off", "batched"):
                    ov = [
                        f"rounds={rounds}",
                        f"eval_every={rounds}",
                        "client_loss=participants",
                        f"device={device}",
                        "plots=false",
                        "verbose=false",
                        "progress=false",
                        f"clients_at_once={'off' if ex == 'off' else batched}",
                        *extra,
                    ]
                    cfg = apply_overrides(P.get(preset), ov + ([f"threads={threads}"] if threads else []))
                    sim = Simulation(cfg, write_outputs=False)
                    summ = sim.run()
                    if (sim.batched is not None) != (ex == "batched"):
                        raise RuntimeError(f"{name}: the {ex} executor did not run (see the warning above)")
                    t = [m["t_local"] for m in sim.metrics[1:]] or [sim.metrics[0]["t_local"]]
                    res[ex].append(statistics.median(t))
                    t_eval[ex].append(sim.metrics[-1]["t_eval"])
                    final[ex] = (sim.global_flat.detach().cpu(), summ.get("final_accuracy"))
                    if sim.batched is not None:
                        memory = {
                            "per_client_mib": sim.batched.per_client / 2**20,
                            "activations_mib": sim.batched.activation_bytes / 2**20,
                            "d": sim.spec.d,
                        }
        except DatasetNotFoundError as e:
            print(f"{name}: skipped ({str(e).splitlines()[0][:120]})", file=sys.stderr)
            continue
        a, b = statistics.median(res["off"]), statistics.median(res["batched"])
        rows.append(
            {
                "preset": name,
                "overrides": extra,
                "clients_per_round": per_round,
                "chunk": batched,
                "rounds": rounds,
                "t_local_round_s": {"sequential": a, "batched": b},
                "speedup": a / b,
                "all_s": res,
                "max_abs_diff_final": float((final["off"][0] - final["batched"][0]).abs().max()),
                "final_accuracy": {"sequential": final["off"][1], "batched": final["batched"][1]},
                "t_eval_s": {k: statistics.median(v) for k, v in t_eval.items()},
                "batched_memory": memory,
            }
        )
        print(
            f"| {name} | {per_round} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | x{a / b:.2f} | "
            f"{rows[-1]['max_abs_diff_final']:.2e} | {statistics.median(t_eval['off']) * 1e3:.1f} ms |",
            flush=True,
        )
    doc = {
        "bench": "sim_compare --executors",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device,
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "loadavg": loadavg(),
            "cuda": torch.cuda.get_device_name() if device == "cuda" else None,
        },
        "threads": threads,
        "repeat": repeat,
        "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out}")
    return 0 if rows else 1


def main(argv: Optional[List[str]] = None) -> int:
    from bench.common import add_out_argument, output_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--tasks", default="demo,cross-device")
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--cd-rounds", type=int, default=None, help="rounds of the cross-device task (default 20)")
    ap.add_argument(
        "--peers-python",
        default=os.environ.get("PEERS", sys.executable),
        help="python of the environment with flwr[simulation] and pfl",
    )
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument(
        "--flower-timeout",
        type=float,
        default=1800,
        help="time limit of a Flower row (1,000 supernodes: Ray start-up and the first round take long)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the --repeat-runners this many times, interleaved (cycle: w1, w2, plain, w1, ...), "
        "so that the ratios between them are measured under the same load; other runners once",
    )
    ap.add_argument("--repeat-runners", default="fedkernels-w1,fedkernels-w2,plain")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads of every single-process runner (default: torch's, = cores); "
        "1 on a machine where other jobs hold cores (OpenMP spin-waits collapse there)",
    )
    add_out_argument(ap)
    ap.add_argument("--executors", action="store_true", help="sequential vs batched executor (module docstring)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="--executors: the device")
    ap.add_argument("--presets", default=EXECUTOR_PRESETS, help="--executors: the presets")
    ap.add_argument("--rounds", type=int, default=4, help="--executors: rounds per run")
    ap.add_argument(
        "--chunk",
        default="round",
        help="--executors: clients_at_once of the batched runs (round = every client of the round; auto; N)",
    )
    a = ap.parse_args(argv)
    if a.executors:
        if a.chunk not in ("round", "auto") and not (a.chunk.isdigit() and int(a.chunk) >= 1):
            ap.error(f"--chunk: expected round, auto or an integer >= 1, got {a.chunk!r}")
        if a.rounds < 1:
            ap.error(f"--rounds: expected an integer >= 1, got {a.rounds}")
        from fedkernels.sim import presets as P

        bad = [x for x in a.presets.split(",") if x not in P.names() and x not in EXECUTOR_CASES]
        if bad:
            ap.error(
                f"--presets: {bad[0]!r} is neither a preset (fedkernels presets lists them) nor one of "
                f"{', '.join(EXECUTOR_CASES)}"
            )
        return executors(
            a.presets,
            a.device,
            a.rounds,
            a.repeat,
            a.chunk if not a.chunk.isdigit() else int(a.chunk),
            a.threads,
            output_path(a.out, f"sim-executors-{a.device}.json"),
        )
    for opt, given, valid in (
        ("--tasks", a.tasks, TASKS),
        ("--runners", a.runners, RUNNERS),
        ("--repeat-runners", a.repeat_runners, RUNNERS),
    ):
        bad = [x for x in given.split(",") if x not in valid]
        if bad:
            ap.error(f"{opt}: {bad[0]!r} is not one of {', '.join(valid)}")
    if a.cd_rounds:
        TASKS["cross-device"]["rounds"] = a.cd_rounds
        os.environ["BENCH_CD_ROUNDS"] = str(a.cd_rounds)
    if os.environ.get("BENCH_CD_ROUNDS"):
        TASKS["cross-device"]["rounds"] = int(os.environ["BENCH_CD_ROUNDS"])
    if a.threads:
        os.environ["BENCH_THREADS"] = str(a.threads)
    if a.run:  # a runner process
        if _bench_threads():
            import torch

            torch.set_num_threads(_bench_threads())
        # through the importable module, not __main__: Flower passes its ClientApp with every message
        # (Ray pickles it each time), and functions of __main__ are pickled by value, so the actors'
        # cached_setup cache would be empty at every message (each client would reload the data set
        # and redo the partition: measured 41.7 s per cross-device round instead of a few)
        import importlib

        res = importlib.import_module("bench.sim_compare").RUN[a.run](a.task)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    rows = []
    load_before = loadavg()
    again = set(a.repeat_runners.split(","))
    for task in a.tasks.split(","):
        for rep in range(max(1, a.repeat)):
            for runner in a.runners.split(","):
                if rep > 0 and runner not in again:
                    continue
                py = a.peers_python if runner in ("flower", "pfl") else sys.executable
                print(f"{task} / {runner} (rep {rep}) ...", file=sys.stderr, flush=True)
                rows.append(launch(runner, task, py, a.flower_timeout if runner == "flower" else a.timeout))
                rows[-1]["rep"] = rep
                print(
                    "  " + json.dumps({k: v for k, v in rows[-1].items() if k != "per_round_s"}),
                    file=sys.stderr,
                    flush=True,
                )
    import platform
    import torch

    doc = {
        "bench": "sim_compare",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        },
        "threads_option": a.threads,
        "repeat": a.repeat,
        "tasks": TASKS,
        "hyper_parameters": HP,
        "command": " ".join(["python -m bench.sim_compare"] + (argv if argv is not None else sys.argv[1:])),
        "rows": rows,
        "ratios": ratios(rows),
    }
    path = output_path(a.out, "sim-compare.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(rows))
    print(f"wrote {path}")
    return 0


def ratios(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per task and runner: per-round median over its repetitions and its ratio to the plain loop
    (the sequential floor) and to fedkernels workers=1, each taken within the same repetition (the
    same load), then the median over repetitions."""
    out: Dict[str, Any] = {}
    ok = [r for r in rows if r.get("round_median_s") is not None and "error" not in r]
    for task in sorted({r["task"] for r in ok}):
        for runner in dict.fromkeys(r["runner"] for r in ok if r["task"] == task):
            mine = [r for r in ok if r["task"] == task and r["runner"] == runner]
            ent = {"round_median_s": statistics.median(r["round_median_s"] for r in mine), "reps": len(mine)}
            for ref_name, key in (("plain", "vs_plain"), ("fedkernels-w1", "vs_fedkernels_w1")):
                refs = {r["rep"]: r for r in ok if r["task"] == task and r["runner"] == ref_name}
                if not refs:
                    continue
                vals = []
                for r in mine:
                    ref = refs.get(r.get("rep"))
                    base = (
                        ref["round_median_s"] if ref else statistics.median(x["round_median_s"] for x in refs.values())
                    )
                    vals.append(r["round_median_s"] / base)
                ent[key] = statistics.median(vals)
                ent[key + "_each"] = vals
            out[f"{task}/{runner}"] = ent
    return out


def table(rows: List[Dict[str, Any]]) -> str:
    out = [
        "| task | runner | rep | threads/process | per round (median r2+, min-max) | vs fedkernels w1 | vs plain loop | "
        "round 1 | start-up | total | local / agg / eval (median) | peak PSS | final acc | load (1 min) start-end |",
        "|" + "---|" * 14,
    ]

    def ref_of(r, name):
        same = [x for x in rows if x["task"] == r["task"] and x["runner"] == name and "error" not in x]
        for x in same:
            if x.get("rep") == r.get("rep"):
                return x["round_median_s"]
        return statistics.median(x["round_median_s"] for x in same) if same else None

    for r in rows:
        load = f"{r.get('loadavg_start', [0])[0]:.1f}-{r.get('loadavg_end', [0])[0]:.1f}"
        if "error" in r:
            got = (
                f"; {r['rounds_run']} rounds done, median {r['round_median_s']:.2f} s/round after round 1"
                if r.get("round_median_s") is not None
                else ""
            )
            out.append(
                f"| {r['task']} | {r['runner']} | {r.get('rep', 0)} | not run to the end: {r['error'][:120]}{got} |"
                + " |" * 9
                + f" {load} |"
            )
            continue
        ratios_ = []
        for name in ("fedkernels-w1", "plain"):
            ref = ref_of(r, name)
            ratios_.append(f"{r['round_median_s'] / ref:.2f}x" if ref else "n/a")
        s = r["median_split_s"]
        out.append(
            f"| {r['task']} | {r['runner']} | {r.get('rep', 0)} | {r.get('threads_per_process')} | "
            f"{r['round_median_s']:.2f} s ({r['round_min_s']:.2f}-{r['round_max_s']:.2f}) | {ratios_[0]} | "
            f"{ratios_[1]} | {r['round1_s']:.2f} s | {r['startup_s']:.2f} s | {r['total_s']:.1f} s | "
            f"{s['t_local']:.2f} / {1e3 * s['t_agg']:.1f} ms / {s['t_eval']:.2f} | "
            f"{r['peak_pss_mib']:.0f} MiB | {100 * (r['final_accuracy'] or 0):.2f}% | {load} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
