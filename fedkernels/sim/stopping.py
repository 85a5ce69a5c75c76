"""Stopping a simulation cleanly on SIGINT / SIGTERM (``Simulation.run``).

The first signal sets :attr:`StopRequest.signal`: the round under way finishes, is checkpointed
(``Checkpoints.on_interrupt``) and the run ends with one line saying how to continue. A second one
abandons the round's local training at once (KeyboardInterrupt; the last completed round is
checkpointed), unless the round is already changing the model (:attr:`StopRequest.committing`, set
by the aggregation phase): then it finishes first. Handlers are installed in the main thread only.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, Optional

__all__ = ["StopRequest"]


class StopRequest:
    """The stop state of one run (``run``: its ``runstate.RunView``; messages on its main process)."""

    def __init__(self, run) -> None:
        self.run = run
        self.signal: Optional[int] = None  # the first signal received, if any
        self.committing = False  # the round under way is changing the model: a signal waits
        self.running = True  # a round (or the set-up before the first) is under way
        self.figures = False  # the figures are being drawn (a second signal may skip them)

    def install(self) -> Callable[[], None]:
        """Installs the handlers; returns the function that restores the previous ones."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        run = self.run

        def say(msg: str) -> None:
            if run.is_main:
                print(msg, file=sys.stderr, flush=True)

        def handler(signum, frame):
            name = signal.Signals(signum).name
            first = self.signal is None
            if first:
                self.signal = signum
            done, total = run.rounds_done, run.cfg.rounds
            if done >= total:  # every round is trained: the outputs are being written
                if first:
                    say(
                        f"{name}: all {total} rounds are done; writing the outputs, then stopping (again to skip "
                        "the figures)"
                    )
                elif self.figures:  # only the figures may be abandoned: the run stays complete
                    say(f"{name} again: abandoning the figures; the run is complete")
                    raise KeyboardInterrupt
                else:
                    say(f"{name}: the results of the complete run are being written; stopping as soon as they are")
                return
            if first:
                if self.running:
                    again = (
                        f"again to abandon it and keep round {done}"
                        if done > 0
                        else "again to stop at once: nothing is kept"
                    )
                    say(f"{name}: finishing round {done + 1}, then writing a checkpoint and stopping ({again})")
                else:
                    say(f"{name}: stopping after round {done}, with its checkpoint")
                return
            if self.committing:  # the model already changed: finish the round, then stop
                say(f"{name}: round {done + 1} is past local training; stopping as soon as it is written")
                return
            if not self.running:  # between rounds: the completed round's files and checkpoint are being written
                say(f"{name}: stopping as soon as round {done}'s checkpoint is written")
                return
            say(
                f"{name} again: abandoning round {done + 1}"
                + (f"; keeping round {done}" if done > 0 else "; no round completed, nothing to keep")
            )
            raise KeyboardInterrupt

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore():
            for s, h in old.items():
                signal.signal(s, h)

        return restore
