"""Provenance of a run: what ran, where, when (``RUN_DIR/provenance.json``) and a timestamped ``run.log``.

    info = provenance.collect(sys.argv)        # versions, git commit, hardware, command, start time
    provenance.write(run_dir, info)            # provenance.json (atomic; a resumed run keeps the
                                               # earlier sessions under "previous")
    log = provenance.RunLog(run_dir); log("round 3/50 acc 71.2%")   # run.log, one UTC-stamped line
    provenance.finish(run_dir, status="completed")   # end time, duration, status

Two runs on different machines, commits or thread counts can then be told apart from their
directories alone. A simulation writes both through its :class:`Provenance` callback.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .callbacks import Callback
from .report import write_json_atomic

FILENAME = "provenance.json"
LOGNAME = "run.log"


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _git(args: Sequence[str], cwd: str) -> Optional[str]:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_info(path: Optional[str] = None) -> Dict[str, Any]:
    """``{"commit", "dirty", "branch"}`` of the git checkout holding ``path`` (default: the fedkernels
    package), or ``{"commit": None}`` when it is not in one (an installed wheel) or git is missing.
    ``dirty`` counts changes to tracked files only."""
    if path is None:
        path = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cwd = path if os.path.isdir(path) else os.path.dirname(path)
    commit = _git(["rev-parse", "HEAD"], cwd)
    if not commit:
        return {"commit": None}
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return {"commit": commit, "dirty": bool(status), "branch": _git(["rev-parse", "--abbrev-ref", "HEAD"], cwd)}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_names() -> List[str]:
    """Names of the visible CUDA devices (empty without CUDA)."""
    import torch

    try:
        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken driver must not stop a run from starting
        return []


def auto_threads(workers: int = 1) -> Tuple[int, str]:
    """(intra-op threads per training process, why) for the machine's current load: the cores this
    process may use less the 1-minute load average (rounded down), at least 1, shared by ``workers``
    processes, and at most torch's default (``OMP_NUM_THREADS`` when set). Two OpenMP threads on a
    2-core machine that is already busy are many times slower than one. The number of threads can
    change a run's bits (CPU kernels round differently), so the CLI writes the choice into the run's
    config (``threads``, part of its config hash) and its provenance."""
    import torch

    from .workers import usable_cores

    cores = usable_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    idle = cores if load is None else max(1, cores - int(load))
    n = max(1, min(idle, torch.get_num_threads()) // max(1, int(workers)))
    why = (
        f"{n} thread(s) per process chosen for the load: {cores} usable core(s), 1-minute load "
        f"{'unknown' if load is None else f'{load:.2f}'}, {workers} process(es), torch default "
        f"{torch.get_num_threads()}; set threads=N to choose"
    )
    return n, why


def collect(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Versions (fedkernels, its git commit and dirty flag, torch, CUDA, Python), hardware (CPU model
    and count, GPU names, torch thread count), host, platform, the command line (``argv``, default
    ``sys.argv``) and the start time (UTC ISO-8601 and Unix seconds)."""
    import torch

    import fedkernels

    argv = list(sys.argv if argv is None else argv)
    try:
        build = fedkernels.build_info()
    except Exception as e:  # noqa: BLE001 - no extension built: record why
        build = {"error": f"{type(e).__name__}: {e}"}
    start = time.time()
    return {
        "fedkernels": fedkernels.__version__,
        "git": git_info(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": gpu_names(),
        "build_info": build,
        "argv": argv,
        "command": shlex.join(argv),
        "cwd": os.getcwd(),
        "start_time": _dt.datetime.fromtimestamp(start, _dt.timezone.utc)
        .isoformat(timespec="seconds")
        .replace("+00:00", "Z"),
        "start_unix": start,
        "end_time": None,
        "duration_s": None,
        "status": "running",
    }


def read(run_dir: str) -> Optional[Dict[str, Any]]:
    """``RUN_DIR/provenance.json`` or None when it is missing."""
    p = os.path.join(run_dir, FILENAME)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def write(run_dir: str, info: Dict[str, Any]) -> str:
    """Writes ``info`` to ``RUN_DIR/provenance.json`` atomically. An existing file from an earlier
    session of the same run directory (a resumed run) is kept under ``"previous"`` (oldest first),
    so every machine and command that contributed rounds is recorded. Returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    old = read(run_dir)
    info = dict(info)
    if old is not None and old.get("start_unix") != info.get("start_unix"):
        prev = list(old.pop("previous", []) or [])
        info["previous"] = prev + [old]
    return write_json_atomic(os.path.join(run_dir, FILENAME), info)


def finish(run_dir: str, status: str = "completed", **extra: Any) -> Optional[Dict[str, Any]]:
    """Records the end time, duration and ``status`` (completed | interrupted | failed | diverged) of
    the current session in ``RUN_DIR/provenance.json``; ``extra`` keys are added (e.g. the last
    round). Returns the updated record, or None when there is no provenance.json."""
    info = read(run_dir)
    if info is None:
        return None
    end = time.time()
    info["end_time"] = (
        _dt.datetime.fromtimestamp(end, _dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    )
    start = info.get("start_unix")
    info["duration_s"] = round(end - start, 3) if isinstance(start, (int, float)) else None
    info["status"] = str(status)
    info.update(extra)
    write_json_atomic(os.path.join(run_dir, FILENAME), info)
    return info


class RunLog:
    """Appends UTC-timestamped lines to ``RUN_DIR/run.log`` (line-buffered; each call one line)::

    log = RunLog(run_dir); log("start: ..."); log.close()
    """

    def __init__(self, run_dir: str, name: str = LOGNAME):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, name)
        self._f = open(self.path, "a", buffering=1)

    def __call__(self, msg: str) -> None:
        if self._f is None:
            return
        for line in str(msg).splitlines() or [""]:
            self._f.write(f"{_utc_now()} {line}\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Provenance(Callback):
    """provenance.json and run.log of a simulation (main process, ``write_outputs``): written at the
    start (versions, commit, hardware, command, start time), every progress line into run.log, and
    at the close (however the run ended) the end line, the status and the rounds completed."""

    def __init__(self) -> None:
        self.log: Optional[RunLog] = None

    def on_start(self, run) -> None:
        if run.write_outputs and run.is_main:
            info = collect(sys.argv)
            if run.attack is not None:  # the run's attackers (sim/attacks.py)
                info["attack"] = run.attack
            if run.lora is not None:  # the run's LoRA mode and ranks (sim/lora.py)
                info["lora"] = run.lora
            how = run.threads_choice or (
                "threads=N in the config" if run.cfg.threads else "torch's default (threads=null)"
            )
            info["threads"] = {"per_process": info["torch_threads"], "workers": run.cfg.workers, "how": how}
            write(run.run_dir, info)
            self.log = RunLog(run.run_dir)

    def on_message(self, run, msg: str, console: bool) -> None:
        if self.log is not None:
            self.log(msg)

    def close(self, run, status: str) -> None:
        """The end line and status; a failed run's cause (``run.failure``) in both files. A file
        that cannot be written (a full disk) is skipped: the error that ended the run is reported."""
        if self.log is None:
            return
        cause = run.failure if status == "failed" else None
        extra = {"error": cause} if cause else {}
        try:
            self.log(f"end: {status} after round {run.rounds_done}" + (f": {cause}" if cause else ""))
            self.log.close()
        except OSError:
            pass
        self.log = None
        try:
            finish(run.run_dir, status=status, rounds_completed=run.rounds_done, **extra)
        except OSError:
            pass
