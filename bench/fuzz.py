"""Fuzzing campaign for every public op in fedkernels.ops and every registered aggregator.

    python -m bench.fuzz --cases 10000            # campaign; writes runs/bench/fuzz.json (--out DIR|FILE.json)
    python -m bench.fuzz --replay '<case json>'   # re-run one case in this process

The case generators and the checkers (the oracle) live in tests/fuzz_oracle.py, shared with
tests/test_fuzz.py; this module runs the cases in a subprocess worker (restarted after a crash
or a timeout) and counts a crash or a per-case timeout (a hang) as a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

import fedkernels

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(_ROOT, "tests") not in sys.path:  # the oracle is a test helper module (tests/ is no package)
    sys.path.insert(0, os.path.join(_ROOT, "tests"))

from bench.common import add_out_argument, output_path  # noqa: E402
from fuzz_oracle import (  # noqa: E402,F401
    _payloads,
    agg_names,
    execute,
    gen_case,
    synthetic_spec,
    targets,
    unfuzzed_ops,
)


# ---------------------------------------------------------------------------------------------
# subprocess worker and campaign
# ---------------------------------------------------------------------------------------------
def _worker() -> None:
    torch.set_num_threads(1)
    import logging

    logging.disable(logging.WARNING)
    for line in sys.stdin:
        case = json.loads(line)
        out, detail = execute(case)
        sys.stdout.write(json.dumps({"outcome": out, "detail": detail[:2000]}) + "\n")
        sys.stdout.flush()


class _Worker:
    def __init__(self):
        self.p = subprocess.Popen(
            [sys.executable, "-m", "bench.fuzz", "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )

    def run(self, case, timeout: float) -> Tuple[str, str]:
        try:
            self.p.stdin.write(json.dumps(case) + "\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            return "crash", f"worker died (exit {self.p.poll()})"
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            return "timeout", f"no result within {timeout:.0f} s"
        line = self.p.stdout.readline()
        if not line:
            return "crash", f"worker died (exit code {self.p.wait()})"
        d = json.loads(line)
        return d["outcome"], d["detail"]

    def close(self, kill=False):
        if kill:
            self.p.kill()
        else:
            try:
                self.p.stdin.close()
            except OSError:
                pass
        self.p.wait()


def campaign(cases: int, seed: int, timeout: float, out_path: Optional[str]) -> Dict[str, Any]:
    rnd = random.Random(seed)
    tg = targets()
    counts = {"ok": 0, "rejected": 0, "fail": 0, "crash": 0, "timeout": 0}
    per_target: Dict[str, Dict[str, int]] = {t: {"ok": 0, "rejected": 0, "fail": 0} for t in tg}
    failures: List[Dict[str, Any]] = []
    w = _Worker()
    t0 = time.time()
    for i in range(cases):
        case = gen_case(rnd, tg[i % len(tg)] if i < len(tg) else None)
        out, detail = w.run(case, timeout)
        if out in ("crash", "timeout"):
            w.close(kill=True)
            w = _Worker()
        counts[out] += 1
        key = "fail" if out in ("fail", "crash", "timeout") else out
        per_target[case["target"]][key] += 1
        if key == "fail" and len(failures) < 200:
            failures.append({"case": case, "outcome": out, "detail": detail})
            print(f"FAIL [{out}] {json.dumps(case)}\n  {detail.splitlines()[0] if detail else ''}", flush=True)
        if (i + 1) % 1000 == 0:
            print(f"  {i + 1}/{cases} cases, {time.time() - t0:.0f} s", flush=True)
    w.close()
    total_fail = counts["fail"] + counts["crash"] + counts["timeout"]
    summary = {
        "cases": cases,
        "seed": seed,
        "timeout_s": timeout,
        "wall_s": round(time.time() - t0, 1),
        "correct": counts["ok"],
        "rejected": counts["rejected"],
        "failures": total_fail,
        "wrong_or_unclear": counts["fail"],
        "crashes": counts["crash"],
        "timeouts": counts["timeout"],
        "targets": per_target,
        "not_fuzzed_ops": unfuzzed_ops(),
        "failure_cases": failures,
        "torch": torch.__version__,
        "build": {k: str(v) for k, v in fedkernels.build_info().items()},
    }
    if out_path:
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--timeout", type=float, default=60.0, help="per-case limit (s)")
    add_out_argument(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replay", help="run one case (JSON) in this process and print the verdict")
    a = ap.parse_args(argv)
    if a.worker:
        _worker()
        return 0
    if a.replay:
        out, detail = execute(json.loads(a.replay))
        print(out, detail)
        return 0 if out != "fail" else 1
    out = output_path(a.out, "fuzz.json")
    s = campaign(a.cases, a.seed, a.timeout, out)
    print(
        f"cases run: {s['cases']}  correct results: {s['correct']}  clean rejections: {s['rejected']}  "
        f"failures: {s['failures']} (wrong/unclear {s['wrong_or_unclear']}, crashes {s['crashes']}, "
        f"timeouts {s['timeouts']})  [{s['wall_s']} s]"
    )
    if s["not_fuzzed_ops"]:
        print("public ops without a fuzz generator:", ", ".join(s["not_fuzzed_ops"]))
    print("wrote", out)
    return 0 if s["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
