"""Per-round server learning-rate schedules read from a file (FedAvg / FedAvgM ``server_lr_schedule``).

The round-t server learning rate is ``server_lr * s_t``. The file is JSON, one of:

    {"server_lr": [s_1, ..., s_T]}
    {"runs": [{"clients": [[ids of round 1], ..., [ids of round T]], "server_lr": [s_1, ..., s_T]}, ...]}

Values are finite numbers >= 0; other keys (provenance, the definition of the values) are ignored.
The second form replays schedules recorded on given sampling streams, e.g. one per seed of another
method's runs (the matched controls of results/REPORT.md): the run whose recorded client set of the
current round equals the round's sampled clients is used, and every later round's client set must
match it too, so a schedule is never applied to a different sampling stream. Bad files, a round
past the end of the schedule and a client set that matches no (or more than one) recorded run raise
ValueError naming the file, the round and what was expected.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, List, Optional, Sequence, Tuple


def _values(vals: Any, where: str) -> List[float]:
    if not isinstance(vals, list) or not vals:
        raise ValueError(f"{where}: 'server_lr' must be a non-empty list of numbers, got {type(vals).__name__}")
    out = []
    for t, v in enumerate(vals):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: server_lr[{t}] = {v!r}; expected a finite number >= 0")
        out.append(float(v))
    return out


def _clients(rounds: Any, n: int, where: str) -> List[frozenset]:
    if not isinstance(rounds, list) or len(rounds) != n:
        got = len(rounds) if isinstance(rounds, list) else type(rounds).__name__
        raise ValueError(f"{where}: 'clients' must be a list of {n} client-id lists (one per value), got {got}")
    out = []
    for t, ids in enumerate(rounds):
        if (
            not isinstance(ids, list)
            or not ids
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
        ):
            raise ValueError(f"{where}: clients[{t}] = {ids!r}; expected a non-empty list of client ids (ints >= 0)")
        out.append(frozenset(ids))
    return out


class ServerLRSchedule:
    """Multipliers s_t of the server learning rate, one per round (see the module docstring)."""

    def __init__(self, runs: Sequence[Tuple[Optional[List[frozenset]], List[float]]], source: str = "<schedule>"):
        self.runs = list(runs)
        self.source = source
        self._chosen: Optional[int] = 0 if len(self.runs) == 1 and self.runs[0][0] is None else None

    @classmethod
    def load(cls, path: str, where: str = "server_lr_schedule") -> "ServerLRSchedule":
        """Reads and validates the JSON file ``path`` (ValueError naming ``where``, the file and the problem)."""
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"{where}={path!r}: expected the path of a JSON schedule file")
        w = f"{where}={os.fspath(path)}"
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"{w}: cannot read the file ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{w}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or ("server_lr" in data) == ("runs" in data):
            raise ValueError(f"{w}: expected a JSON object with either 'server_lr' (a list of numbers) or 'runs'")
        if "server_lr" in data:
            return cls([(None, _values(data["server_lr"], w))], os.fspath(path))
        runs = data["runs"]
        if not isinstance(runs, list) or not runs:
            raise ValueError(f"{w}: 'runs' must be a non-empty list of {{'clients', 'server_lr'}} objects")
        out = []
        for j, r in enumerate(runs):
            wj = f"{w} runs[{j}]"
            if not isinstance(r, dict) or "server_lr" not in r or "clients" not in r:
                raise ValueError(f"{wj}: expected an object with 'clients' and 'server_lr'")
            vals = _values(r["server_lr"], wj)
            out.append((_clients(r["clients"], len(vals), wj), vals))
        return cls(out, os.fspath(path))

    def value(self, round_index: int, clients: Sequence[int]) -> float:
        """s_t of round ``round_index`` (0-based) whose sampled clients are ``clients``."""
        r = int(round_index)
        ids = frozenset(int(c) for c in clients)
        if self._chosen is None:
            hits = [j for j, (cl, vals) in enumerate(self.runs) if r < len(vals) and cl[r] == ids]
            if len(hits) != 1:
                raise ValueError(
                    f"server_lr_schedule={self.source}: round {r + 1} sampled clients {sorted(ids)}, "
                    f"which {'no' if not hits else 'more than one'} recorded run has at that round; "
                    "expected the sampling stream (seed, partition, clients per round) of exactly one run"
                )
            self._chosen = hits[0]
        cl, vals = self.runs[self._chosen]
        if r >= len(vals):
            raise ValueError(
                f"server_lr_schedule={self.source}: round {r + 1} has no value; the schedule has {len(vals)} rounds"
            )
        if cl is not None and cl[r] != ids:
            raise ValueError(
                f"server_lr_schedule={self.source}: round {r + 1} sampled clients {sorted(ids)}, "
                f"but the recorded run (runs[{self._chosen}]) had {sorted(cl[r])}; "
                "expected the same sampling stream"
            )
        return vals[r]
