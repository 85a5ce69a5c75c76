"""Byzantine attacks in the simulator (config section ``attack``), so that a rule's robustness is
measured, not claimed.

The attackers are a fixed set of client ids for the whole run: ``attack.clients``, or
``round(attack.fraction * num_clients)`` ids drawn once from the run seed. An attacker trains like
every client; what it sends depends on ``attack.kind``:

* ``sign_flip``: -U_k (its honest update reversed);
* ``scale``: ``factor`` U_k (``factor`` > 0, default: K, the clients of the round: the boost of model
  replacement, Bagdasaryan et al. 2020, with server learning rate 1);
* ``gaussian``: N(0, std^2) in every coordinate (drawn from the run seed and the round);
* ``alie`` ("A little is enough", Baruch et al., NeurIPS 2019): mu - z sigma, mu and sigma the
  coordinate-wise mean and (population) standard deviation of the round's honest updates, z from the
  paper: s = floor(n/2 + 1) - f, z = Phi^-1((n - s) / n) with n the round's clients and f its attackers
  (``attack.z`` overrides it);
* ``ipm`` (inner-product manipulation, Xie, Koyejo, Gupta, UAI 2020): -epsilon mu;
* ``label_flip``: data poisoning: the attackers train on labels c -> C - 1 - c (their own examples).

The omniscient attacks (alie, ipm) see the round's honest updates: the rows of the round's update
buffer written by the clients that are not attackers, after local training and before aggregation
(``Attack.corrupt``, called by ``Simulation.run_round``). Every attacker of a round sends the same
vector. metrics.jsonl records per round ``attack``: the round's attackers and, for a rule that selects
clients (``info["selected"]``: krum, bulyan), how many of them were selected; provenance.json records
the kind, options and attacker set.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

KINDS = ("sign_flip", "scale", "gaussian", "alie", "ipm", "label_flip")
# the kind-specific options of AttackConfig: the kinds that read each
OPTION_KINDS = {"factor": ("scale",), "std": ("gaussian",), "z": ("alie",), "epsilon": ("ipm",)}
_SEED_SALT = 0x5A77AC  # the attackers' draw: its own stream of the run seed


def attack_errors(cfg: Any) -> List[str]:
    """One line per invalid ``attack.*`` key of run config ``cfg`` (empty: valid or no attack)."""
    a = cfg.attack
    given = [k for k in ("fraction", "clients", *OPTION_KINDS) if getattr(a, k) is not None]
    if a.kind is None:
        return (
            [f"attack.{given[0]}={getattr(a, given[0])!r} needs attack.kind (one of {', '.join(KINDS)})"]
            if given
            else []
        )
    if a.kind not in KINDS:
        return [f"attack.kind must be one of {', '.join(KINDS)}, got {a.kind!r}"]
    if (a.fraction is None) == (a.clients is None):
        return [
            f"attack.kind={a.kind} needs exactly one of attack.fraction or attack.clients, got "
            f"{'both' if a.fraction is not None else 'neither'}"
        ]
    for key, kinds in OPTION_KINDS.items():
        if getattr(a, key) is not None and a.kind not in kinds:
            return [f"attack.{key}={getattr(a, key)!r} is an option of attack.kind={kinds[0]}, not {a.kind}"]
    n = cfg.num_clients  # (the numbers' ranges: config.RANGES, checked before this)
    if a.fraction is not None:
        if round(a.fraction * n) < 1:
            return [f"attack.fraction={a.fraction} of num_clients={n} is no attacker (round(fraction * n) = 0)"]
    else:
        c = list(a.clients)
        if not c or len(set(c)) != len(c) or min(c) < 0 or max(c) >= n:
            return [f"attack.clients must be distinct client ids in [0, num_clients={n}), got {c}"]
    if cfg.distributed:
        return [
            "attack.kind is not supported with distributed=true (the ranks hold column slices of the "
            "round's updates); run in one process (workers=N or clients_at_once also work)"
        ]
    return []


def alie_z(n: int, f: int) -> float:
    """Baruch et al.'s z_max for n clients of which f attack: s = floor(n/2 + 1) - f,
    z = Phi^-1((n - s) / n)."""
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    from statistics import NormalDist

    return NormalDist().inv_cdf(min(max(p, 1e-12), 1 - 1e-12))


class Attack:
    """A run's attack: the attacker set and what the attackers send (see the module's docstring)."""

    def __init__(self, cfg: Any):
        a = cfg.attack
        self.kind: str = a.kind
        self.cfg = a
        self.seed = int(cfg.seed)
        if a.clients is not None:
            ids = sorted(int(c) for c in a.clients)
        else:
            g = torch.Generator().manual_seed(self.seed ^ _SEED_SALT)
            n = int(round(a.fraction * cfg.num_clients))
            ids = sorted(torch.randperm(cfg.num_clients, generator=g)[:n].tolist())
        self.attackers: List[int] = ids
        self._set = set(ids)

    def describe(self) -> Dict[str, Any]:
        """What provenance.json records."""
        opts = {k: getattr(self.cfg, k) for k in OPTION_KINDS if self.kind in OPTION_KINDS[k]}
        return {"kind": self.kind, "attackers": list(self.attackers), "options": opts}

    def poison_labels(self, y: torch.Tensor, parts: Sequence[torch.Tensor], num_classes: int) -> torch.Tensor:
        """``label_flip``: a copy of the training labels with the attackers' examples relabelled
        c -> C - 1 - c (the honest clients' labels unchanged); other kinds: ``y`` itself."""
        if self.kind != "label_flip":
            return y
        y = y.clone()
        idx = torch.cat([parts[c].to(y.device) for c in self.attackers]) if self.attackers else None
        if idx is not None and idx.numel():
            y[idx] = (num_classes - 1) - y[idx]
        return y

    def corrupt(self, r: int, U: torch.Tensor, client_ids: Sequence[int]) -> Optional[List[int]]:
        """Replaces the attackers' rows of the round's ``U`` (row k = ``client_ids[k]``) in place; returns
        the round's attackers (client ids, schedule order), or None when none was sampled."""
        rows = [k for k, c in enumerate(client_ids) if c in self._set]
        if not rows:
            return None
        who = [int(client_ids[k]) for k in rows]
        if self.kind == "label_flip":
            return who  # (poisoned at the data level)
        idx = torch.tensor(rows, dtype=torch.long, device=U.device)
        K = U.size(0)
        if self.kind == "sign_flip":
            U.index_copy_(0, idx, -U.index_select(0, idx))
        elif self.kind == "scale":
            factor = float(K) if self.cfg.factor is None else float(self.cfg.factor)
            U.index_copy_(0, idx, U.index_select(0, idx) * factor)
        elif self.kind == "gaussian":
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + r) ^ _SEED_SALT)
            noise = torch.randn(len(rows), U.size(1), generator=g, dtype=torch.float64)
            std = 1.0 if self.cfg.std is None else float(self.cfg.std)
            U.index_copy_(0, idx, (noise * std).to(device=U.device, dtype=U.dtype))
        else:
            bad = set(rows)
            honest = [k for k in range(K) if k not in bad] or list(range(K))
            H = U.index_select(0, torch.tensor(honest, dtype=torch.long, device=U.device)).to(torch.float64)
            mu = H.mean(0)
            if self.kind == "alie":
                z = alie_z(K, len(rows)) if self.cfg.z is None else float(self.cfg.z)
                mal = mu - z * H.std(0, correction=0)
            else:  # ipm
                eps = 0.1 if self.cfg.epsilon is None else float(self.cfg.epsilon)
                mal = -eps * mu
            U.index_copy_(0, idx, mal.to(U.dtype).unsqueeze(0).expand(len(rows), -1))
        return who

    def record(self, who: Optional[List[int]], info: Dict[str, Any]) -> Dict[str, Any]:
        """The round's ``attack`` entry of metrics.jsonl."""
        out: Dict[str, Any] = {"attackers": who or []}
        sel = info.get("selected")
        if sel is not None:
            out["selected"] = sum(1 for c in sel if c in self._set)
            out["selected_of"] = len(sel)
        return out


def for_run(cfg: Any) -> Optional[Attack]:
    """The run's Attack, or None without ``attack.kind``."""
    return Attack(cfg) if getattr(cfg, "attack", None) is not None and cfg.attack.kind is not None else None
