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
    """The stop state of one run of ``sim`` (messages on its main process)."""

    def __init__(self, sim) -> None:
        self.sim = sim
        self.signal: Optional[int] = None   # the first signal received, if any
        self.committing = False             # the round under way is changing the model: a signal waits

    def install(self) -> Callable[[], None]:
        """Installs the handlers; returns the function that restores the previous ones."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        sim = self.sim

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.signal is None:
                self.signal = signum
                if sim.is_main:
                    keep = f" and keep round {sim.start_round}" if sim.start_round > 0 else ""
                    print(f"{name}: finishing round {sim.start_round + 1} and writing a checkpoint (again to "
                          f"abandon the round{keep})", file=sys.stderr, flush=True)
                return
            if self.committing:   # the model already changed: finish the round, then stop
                if sim.is_main:
                    print(f"{name}: round {sim.start_round + 1} is past local training; stopping as soon as it "
                          "is written", file=sys.stderr, flush=True)
                return
            raise KeyboardInterrupt

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore():
            for s, h in old.items():
                signal.signal(s, h)
        return restore
