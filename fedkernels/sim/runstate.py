"""What the round loop hands to its hooks, instead of the whole :class:`~fedkernels.sim.simulation.Simulation`.

Two objects, built once at set-up by the loop (``Simulation.setup``):

* :class:`LocalTraining` (frozen): what local training reads of a set-up run: the config, the model
  and its flat space, the trainer, the global model vector, the update buffer, the per-client
  learning rates and epochs, the method's client rules (:class:`ClientRules`), the data (for the
  workers' evaluation) and how rows are screened, clipped and measured as they are written. The
  executors (``sim/executors.py``, ``sim/batched.py``, ``sim/workers.py``) and
  ``trainer.train_client`` take it; ``workers=N`` sends it, pickled once, to the worker processes.
* :class:`RunView`: a read-only view of the run for the callbacks (``sim/callbacks.py``): its
  config and directory, the rounds done, the metrics so far, the global model; ``say(msg)`` for a
  progress line and ``state(rnd, rng)`` for a checkpoint's state. A callback never writes into the
  run: what it reports back is its return value (:meth:`~fedkernels.sim.callbacks.Callback.after_round`:
  stop, extra metrics) or a named outcome (:meth:`RunView.note_output_error`, :meth:`RunView.figures`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

__all__ = ["ClientRules", "LocalTraining", "RunView", "sync"]


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on the CPU): the phases' timings measure work done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ClientRules:
    """The method's client rule per client (``agg.client_rule()``): a stateful rule (one with
    ``state_dict``/``load_state_dict``) is kept per client across rounds and checkpointed; a
    stateless one is built fresh each time."""

    __slots__ = ("agg", "kept")

    def __init__(self, agg, kept: Optional[Dict[int, Any]] = None) -> None:
        self.agg = agg
        self.kept: Dict[int, Any] = {} if kept is None else kept

    def fresh(self):
        """A new rule (None: the method trains plain SGD)."""
        return self.agg.client_rule()

    def get(self, cid: int):
        """Client ``cid``'s rule: its kept one, or a new one (kept when it is stateful)."""
        if cid in self.kept:
            return self.kept[cid]
        rule = self.agg.client_rule()
        if rule is not None and hasattr(rule, "state_dict") and hasattr(rule, "load_state_dict"):
            self.kept[cid] = rule
        return rule

    def state_dict(self) -> Dict[int, Any]:
        return {int(c): r.state_dict() for c, r in self.kept.items()}

    def load_state_dict(self, st: Dict[Any, Any]) -> None:
        for c, rs in st.items():
            rule = self.agg.client_rule()
            rule.load_state_dict(rs)
            self.kept[int(c)] = rule


@dataclass(frozen=True)
class LocalTraining:
    """What local training reads of a set-up run (module docstring). Its tensors and containers are
    the run's own: a client writes its row into ``buf`` (and, for server-side DP, its norm into
    ``dp_norms``); nothing else changes through it."""

    cfg: Any  # the RunConfig (train, seed, bad_client_policy, clients_at_once, ...)
    device: torch.device
    spec: Any  # the FlatSpec of the model
    model: nn.Module  # its tensors are views of trainer.work
    trainer: Any  # trainer.ClientTrainer
    global_flat: torch.Tensor  # the global model (read only by the clients)
    buf: Any  # the round's UpdateBuffer
    hetero: Any  # hetero.HeteroCompute: (base lr, epochs) per client and round
    rules: ClientRules
    screen_at_write: bool  # each row screened as it is written (policy "raise", ranks)
    client_clip: Optional[float]  # client-side DP: each row clipped to this norm as it is written
    dp_norms: Optional[Dict[int, float]]  # server-side DP in one process: each row's norm, by client id
    x: torch.Tensor
    y: torch.Tensor
    xt: torch.Tensor
    yt: torch.Tensor
    parts: Sequence[torch.Tensor]  # each client's sample indices
    per_round: int  # clients per round
    progress: bool = False  # progress bars (the main process, where `progress` says)
    tag: str = ""  # the process's tag in progress bars (" (rank q)")
    lora: Any = None  # sim/lora.LoraRun when clients train at ranks below the server's

    def sync(self) -> None:
        sync(self.device)


def _through(name: str, doc: str) -> property:
    """A read-only property of :class:`RunView`: the run's attribute ``name``, as it is now."""
    return property(lambda self: getattr(self._sim, name), doc=doc)


class RunView:
    """A read-only view of one run for its callbacks (module docstring). Attributes read through to
    the run as it is now (``rounds_done`` grows after every round)."""

    __slots__ = ("_sim",)

    def __init__(self, sim) -> None:
        object.__setattr__(self, "_sim", sim)

    def __setattr__(self, name, value):
        raise AttributeError(f"RunView is read-only (cannot set {name!r}): a callback reports back by its return value")

    # ---- what the run is -----------------------------------------------------------------------------
    cfg = _through("cfg", "The run's RunConfig.")
    run_dir = _through("run_dir", "The run directory.")
    ckpt_dir = _through("ckpt_dir", "Its checkpoints' directory.")
    write_outputs = _through("write_outputs", "Whether the run writes its directory.")
    is_main = _through("is_main", "True on the process that evaluates and writes (always, in one process).")
    resume = _through("resume", "Whether this session continues a run from its checkpoint.")
    device = _through("device", "The run's device.")
    per_round = _through("per_round", "Clients per round.")
    labels = _through("y", "The training labels (as trained: label_flip attackers' poisoned).")
    parts = _through("parts", "Each client's training-sample indices.")

    @property
    def d(self) -> int:
        """The model's size (the flat vector's length)."""
        return self._sim.spec.d

    @property
    def names(self) -> List[str]:
        """The flat vector's tensor names, in order."""
        return self._sim.spec.names

    @property
    def progress(self) -> bool:
        """Whether progress bars are shown (the main process, where ``progress`` says)."""
        return self._sim.progress_enabled()

    @property
    def attack(self) -> Optional[Dict[str, Any]]:
        """The run's attackers described (sim/attacks.py), or None."""
        a = getattr(self._sim, "attack", None)
        return None if a is None else a.describe()

    @property
    def lora(self) -> Optional[Dict[str, Any]]:
        """The run's LoRA mode and ranks described (sim/lora.py), or None."""
        lo = getattr(self._sim, "lora", None)
        return None if lo is None else lo.describe()

    @property
    def threads_choice(self) -> Optional[str]:
        """How the thread count was chosen (the CLI says), or None."""
        return getattr(self._sim, "threads_choice", None)

    # ---- where it is ------------------------------------------------------------------------------------
    rounds_done = _through("start_round", "Rounds completed (a resumed run: counted from the run's first round).")
    first_round = _through("first_round", "Rounds done when this session started (> 0: a resumed run).")

    @property
    def metrics(self) -> Sequence[Dict[str, Any]]:
        """Every completed round's metrics (a tuple; its dicts are the ones metrics.jsonl holds)."""
        return tuple(self._sim.metrics)

    cut_short = _through(
        "cut_short", "Whether this session stopped before its rounds were done (a signal, or ``stop_after``)."
    )

    @property
    def failure(self) -> Optional[str]:
        """A failed run's cause, one line (None otherwise)."""
        return getattr(self._sim, "failure", None)

    global_flat = _through(
        "global_flat", "The global model as a flat vector (the run's own tensor: read it, do not write it)."
    )

    def global_model(self) -> nn.Module:
        """The model module holding the current global model."""
        return self._sim.global_model()

    def state(self, rnd: int, rng: Optional[torch.Tensor] = None) -> Optional[Dict[str, Any]]:
        """The state after round ``rnd`` as a checkpoint holds it (``Simulation.state``; a collective
        under torch.distributed, None off the main process)."""
        return self._sim.state(rnd, rng)

    # ---- what a callback may say -------------------------------------------------------------------------
    def say(self, msg: str, console: bool = True) -> None:
        """A progress line (main process only): run.log always, the terminal when ``console`` and ``verbose``."""
        self._sim.say(msg, console)

    @contextlib.contextmanager
    def figures(self) -> Iterator[None]:
        """The figures are being drawn: a second signal may abandon them (``sim/stopping.py``)."""
        stop = self._sim.stop
        stop.figures = True
        try:
            yield
        finally:
            stop.figures = False

    def figures_abandoned(self) -> None:
        """A signal abandoned the figures: an incomplete run is then an interrupted one."""
        self._sim.note_interrupted()

    def note_output_error(self, msg: str) -> None:
        """An output that could not be written (one line; the CLI reports it and exits 1)."""
        self._sim.output_errors = [*getattr(self._sim, "output_errors", []), msg]
