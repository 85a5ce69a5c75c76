"""Matched server-learning-rate controls (results/REPORT.md §2):

    PYTHONPATH=. python results/scripts/matched_server_lr.py --preset fedaware-fmnist --method fedaware \\
        --seeds 0,1,2 --rounds 100 --log-out results/fedaware/fmnist-steplog \\
        --out results/fedaware/fmnist-lrmatched --controls fedavg,fedavgm [key=value ...]

Definition. For every round t of the method's run (seed s), with x_t the global model, U_k the
round's client updates and p_k = n_k / sum n over the round's participants,

    r_t = ||x_{t+1} - x_t|| / ||sum_k p_k U_k||

is the method's applied server step measured in units of the plain FedAvg step of the same round's
updates (1 where the method takes the FedAvg step, e.g. FedAWARE's explore rounds). The controls
(the preset's FedAvg, FedAvgM, ... with their preset options) then run on the same seed, hence the
same partition and client-sampling stream, with server learning rate r_t in round t
(``server_lr_schedule``, fedkernels.algorithms.server_lr). The schedule file has one recorded run
per seed, with its clients per round; FedAvg checks that it replays the run whose sampling stream
it is on.

Steps (each skipped when its output exists, so an interrupted job can be re-run):
1. ``--log-out``: the method's runs again, as ``fedkernels compare`` runs them, with two numbers
   added to each round's ``agg`` info: ``step_norm`` = ||x_{t+1} - x_t|| and ``fedavg_step_norm``
   = ||sum_k p_k U_k||. Only logging is added (the runs are otherwise identical to the committed ones).
2. ``--out``/schedule.json: r_t per seed and round, with the clients of each round (when every seed
   samples the same clients in every round, e.g. full participation, the clients cannot tell the seeds
   apart: the schedule is then the per-round mean of r_t over the seeds, replayed by every seed).
3. ``--out``: ``compare`` of the controls, labelled ``<method>-lrmatched``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
import torch  # noqa: E402

from fedkernels import ops  # noqa: E402
from fedkernels.sim import presets  # noqa: E402
from fedkernels.sim.compare import compare  # noqa: E402
from fedkernels.sim.config import apply_overrides  # noqa: E402
from fedkernels.sim.simulation import Simulation  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runstore  # noqa: E402  (archived or on-disk run directories)


def log_step_norms(agg):
    """Wraps ``agg.aggregate`` so that each round's info also holds step_norm and fedavg_step_norm."""
    inner = agg.aggregate

    def aggregate(global_flat, updates, num_examples, client_ids=None, payloads=None, **kw):
        res = inner(global_flat, updates, num_examples, client_ids, payloads, **kw)
        n = torch.as_tensor(num_examples, dtype=torch.float64)
        res.info["fedavg_step_norm"] = ops.sqnorm(ops.weighted_sum(updates, n / n.sum())) ** 0.5
        res.info["step_norm"] = ops.sqnorm(res.params.double() - global_flat.double()) ** 0.5
        return res

    agg.aggregate = aggregate
    return agg


def _metrics(run_dir):
    files, run = runstore.open_setup(os.path.dirname(run_dir), cached=False), os.path.basename(run_dir)
    if not files.exists(f"{run}/metrics.jsonl"):  # (a gzipped one on disk reads under this name)
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl(.gz), on disk or in {files.archive}")
    return files.metrics(run)


def _done(setup_dir):
    """A compare step's output exists: its compare.json, on disk or in the setup's archive."""
    return runstore.open_setup(setup_dir, cached=False).exists("compare.json")


def schedule(log_dir, label, seeds, rounds):
    runs = []
    for s in seeds:
        m = _metrics(os.path.join(log_dir, f"{label}-s{s}"))
        if len(m) != rounds:
            raise ValueError(f"{log_dir}/{label}-s{s}: {len(m)} rounds logged, expected {rounds}")
        if any(r.get("excluded") for r in m):
            raise ValueError(f"{log_dir}/{label}-s{s}: a round excluded a client; r_t is defined on full rounds")
        r = [g["agg"]["step_norm"] / g["agg"]["fedavg_step_norm"] for g in m]
        runs.append({"seed": s, "clients": [g["clients"] for g in m], "server_lr": r})
    out = {
        "definition": "server_lr[t] = ||x_{t+1} - x_t|| / ||sum_k p_k U_k|| in round t of the recorded run "
        "(p_k = n_k / sum n over the round's participants); FedAvg/FedAvgM replay it as their "
        "round-t server learning rate on the same sampling stream",
        "source": os.path.relpath(log_dir, REPO),
        "method": label,
    }
    if len(runs) > 1 and all(r["clients"] == runs[0]["clients"] for r in runs):
        # every seed samples the same clients (e.g. full participation): the sampling stream cannot tell
        # the seeds' schedules apart, so every seed replays the per-round mean over the seeds
        out["definition"] += (
            "; here every seed sampled the same clients in every round, so the schedule is "
            "the per-round mean of r_t over the seeds " + str(seeds) + " (per seed: 'per_seed')"
        )
        out["per_seed"] = {str(r["seed"]): r["server_lr"] for r in runs}
        out["server_lr"] = [sum(v) / len(v) for v in zip(*(r["server_lr"] for r in runs))]
        return out
    out["runs"] = runs
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--method", required=True, help="the preset's method label whose step is matched")
    ap.add_argument("--controls", default="fedavg,fedavgm", help="preset method labels run with the matched schedule")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--log-out", required=True)
    ap.add_argument("--out", help="directory of schedule.json and the controls (required unless --log-only)")
    ap.add_argument("--log-only", action="store_true", help="step 1 only: measure r_t, run no control")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (as fedkernels compare)")
    a = ap.parse_args(argv)
    if not a.log_only and not a.out:
        ap.error("--out is required unless --log-only")
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    known = presets.variants(a.preset)
    for lab in [a.method] + ([] if a.log_only else a.controls.split(",")):
        if lab not in known:
            raise SystemExit(f"{lab!r} is not a method of preset {a.preset} ({', '.join(known)})")
    base = apply_overrides(presets.get(a.preset), a.overrides)
    base.progress, base.verbose = False, False
    if not _done(a.log_out):
        build = Simulation._build_aggregator
        Simulation._build_aggregator = lambda self: log_step_norms(build(self))
        try:
            compare(
                base, [(a.method, known[a.method])], seeds=seeds, out_dir=a.log_out, rounds=a.rounds, preset=a.preset
            )
        finally:
            Simulation._build_aggregator = build
    if a.log_only:
        return 0
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "schedule.json")
    if not os.path.exists(path):
        sched = schedule(a.log_out, a.method, seeds, a.rounds)
        with open(path, "w") as f:
            json.dump(sched, f)
    rel = os.path.relpath(path, os.getcwd())
    ctrls = []
    for lab in a.controls.split(","):
        v = json.loads(json.dumps(known[lab]))
        v.setdefault("options", {})["server_lr_schedule"] = rel
        ctrls.append((f"{lab}-lrmatched", v))
    if not _done(a.out):
        compare(base, ctrls, seeds=seeds, out_dir=a.out, rounds=a.rounds, preset=a.preset, baseline=ctrls[0][0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
