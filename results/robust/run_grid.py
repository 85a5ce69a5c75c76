"""The robustness grid: every attack (and none) x every rule x seeds, Fashion-MNIST, 20% attackers.

    nice python results/robust/run_grid.py --out runs/robust [--seeds 0 1 2] [--only RULE ...]

Each run is small (15 clients all taking part, 3 of them attackers, a 1-hidden-layer MLP, 20 rounds of
10 local steps on a 6000-example subset); one process runs them one after the other and appends one
JSON line per finished run (a run stopped by a RunError, e.g. every update NaN after the model blew up,
is recorded as diverged with its error) to --log (default results/robust/grid.jsonl; a rerun skips the
runs already there).
"""

from __future__ import annotations

import argparse
import json
import os
import time

RULES = {
    "fedavg": {},
    "median": {},
    "trimmed_mean": {"beta": 0.2},
    "krum": {"f": 3},
    "bulyan": {"f": 3},
    "geometric_median": {},
    "centered_clip": {"tau": 1.0},
}
# label -> the attack section (kind and options; defaults of fedkernels.sim.attacks otherwise)
ATTACKS = {
    "none": None,
    "sign_flip": {"kind": "sign_flip"},
    "scale": {"kind": "scale"},
    "gaussian": {"kind": "gaussian"},
    "alie": {"kind": "alie"},
    "alie_z1.5": {"kind": "alie", "z": 1.5},
    "ipm": {"kind": "ipm", "epsilon": 0.1},
    "ipm100": {"kind": "ipm", "epsilon": 100.0},
    "label_flip": {"kind": "label_flip"},
}
BASE = {
    "rounds": 20,
    "num_clients": 15,
    "participation": 1.0,
    "eval_every": 5,
    "client_loss": "none",
    "data": {"name": "fmnist", "train_subset": 6000, "test_subset": 2000},
    "partition": {"scheme": "iid"},
    "model": {"name": "mlp", "options": {"hidden": [64]}},
    "train": {"steps": 10, "batch_size": 32, "lr": 0.05},
    "plots": False,
    "verbose": False,
    "threads": 1,
}


def config(rule: str, attack: str, seed: int, out: str):
    from fedkernels.sim.config import RunConfig

    d = json.loads(json.dumps(BASE))
    d.update(seed=seed, out_dir=out, name=f"{rule}-{attack}-s{seed}", algorithm={"name": rule, "options": RULES[rule]})
    if ATTACKS[attack] is not None:
        d["attack"] = {"fraction": 0.2, **ATTACKS[attack]}
    return RunConfig.from_dict(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/robust")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--log", default="results/robust/grid.jsonl")
    a = ap.parse_args()
    from fedkernels.errors import RunError
    from fedkernels.sim import Simulation

    os.makedirs(a.out, exist_ok=True)
    log = a.log
    done = set()
    if os.path.exists(log):
        with open(log) as f:
            done = {(r["rule"], r["attack"], r["seed"]) for r in map(json.loads, f)}
    for seed in a.seeds:
        for attack in ATTACKS:
            for rule in RULES:
                if (a.only and rule not in a.only) or (rule, attack, seed) in done:
                    continue
                t0 = time.time()
                sim = Simulation(config(rule, attack, seed, a.out), overwrite=True)
                try:
                    sim.run()
                    error = None
                except RunError as e:  # e.g. every client's update NaN from a blown-up model
                    error = str(e)
                last = sim.metrics[-1] if sim.metrics and error is None else {"diverged": True}
                sel = [m["attack"].get("selected") for m in sim.metrics if "attack" in m]
                rec = {
                    "rule": rule,
                    "attack": attack,
                    "seed": seed,
                    "accuracy": last.get("accuracy"),
                    "diverged": bool(last.get("diverged", False)),
                    "attackers": sim.attack.attackers if sim.attack else [],
                    "selected_per_round": sel if any(s is not None for s in sel) else None,
                    "curve": [[m["round"], m["accuracy"]] for m in sim.metrics if "accuracy" in m],
                    "error": error,
                    "rounds_done": len(sim.metrics),
                    "wall_s": round(time.time() - t0, 2),
                }
                with open(log, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
