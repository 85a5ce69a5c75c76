"""Run ``python -m fedkernels ...`` (and other ``python -m/-c/script`` commands) in a real child
process that skips the interpreter's start and the torch import: ``run`` is ``subprocess.run`` for a
command that starts with ``sys.executable``.

    import cli_process
    p = cli_process.run([sys.executable, "-m", "fedkernels", "run", "--preset", "smoke"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr

Why: a fresh interpreter spends about 2 CPU-seconds importing torch and fedkernels (7 for a smoke
run, which also imports torch._dynamo, scikit-learn and matplotlib) before the command does anything,
and the CLI tests start hundreds of them.

How (a zygote): the first call in a process (one per pytest-xdist worker) starts one helper
interpreter, the zygote, which imports torch, fedkernels, the CLI and the modules a run imports
later (``PRELOAD``), then waits for requests on a pipe. It never runs a torch operation, so
OpenMP's thread pool (libgomp is not fork-safe once its pool has started) and autograd's threads
have not started when it forks. Each request is forked from it: the child takes the command's argv
(``sys.argv``, ``sys.orig_argv``, ``sys.path[0]`` as the interpreter would set them), working
directory, environment (``os.environ`` replaced) and stdin, writes stdout and stderr to files of its
own, sets torch's intra-op threads from ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` as torch does when it
starts (else the default the zygote found), runs the module / code / script as ``__main__`` with
``runpy``, and exits as the interpreter would: the ``SystemExit`` code, 1 with the traceback on
stderr for an uncaught exception, killed by SIGINT for an uncaught ``KeyboardInterrupt``; non-daemon
threads are joined and atexit handlers run first. The zygote reaps its children and reports each
exit status (``CLI_PROCESS_CPU_LOG=FILE``: each zygote appends how many commands it ran and their CPU
seconds when it exits); ``timeout`` kills the child (SIGKILL) and raises ``subprocess.TimeoutExpired`` as
``subprocess.run`` does. The zygote exits when the process that started it closes the pipe (at
its exit, or when it dies), so no session fixture is needed. A zygote of our own rather than
multiprocessing's forkserver: the simulator's ``workers=N`` uses that (one per process, its preload
fixed by whoever starts it first), and a child here must be a plain process that exits with the
command's status, not a ``multiprocessing.Process``.

What a forked child cannot do (use ``subprocess`` and a fresh interpreter for those): anything read
when Python, torch or fedkernels start — ``FEDKERNELS_MARCH`` and the build guard, OpenMP/MKL
settings other than the thread count (``OMP_PROC_BIND``, ``KMP_*``, ``GOMP_*``), ``PYTHONHASHSEED``,
``PYTHONWARNINGS``, ``PYTHONPATH`` entries that shadow an already imported module, interpreter
flags (``-X``, ``-W``, ``-I``...); the installed ``fedkernels`` console script and packaging; tests
of signals, kill and resume (they talk to a running child through ``Popen``); torchrun and
``torch.distributed`` launchers; shell pipelines. Every subcommand also keeps at least one test
that runs the real command in a fresh interpreter.
"""

from __future__ import annotations

import atexit
import locale
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

# imported once by the zygote (a missing optional one is skipped): torch and the CLI, then what a
# `fedkernels run` imports when it needs it (torch._dynamo, scikit-learn's data sets, matplotlib)
PRELOAD = (
    "numpy",
    "torch",
    "fedkernels",
    "fedkernels.sim.cli",
    "fedkernels.sim.simulation",
    "fedkernels.sim.checkpoint",
    "fedkernels.sim.data",
    "fedkernels.sim.workers",
    "yaml",
    "tqdm",
    "torch._dynamo",
    "sklearn.datasets",
    "matplotlib",
    "matplotlib.pyplot",
)
# read by torch when it starts (its intra-op thread count), applied in each child the same way
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_HEADER = struct.Struct("!Q")
# the zygote's environment: this process's at collection time, before a test changes os.environ
_START_ENV = dict(os.environ)


def _send(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = _HEADER.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def _recv(fd: int):
    """One message, or None at end of file."""
    head = _read_exactly(fd, _HEADER.size)
    if head is None:
        return None
    body = _read_exactly(fd, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(fd: int, n: int):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# ---- the zygote (runs in its own interpreter: `python -c "import cli_process; cli_process._zygote(R, W)"`) ----


def _zygote(req_fd: int, resp_fd: int) -> None:
    import gc
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import torch

    default_threads = torch.get_num_threads()  # the zygote starts without the thread variables
    zygote_path = _pythonpath(os.environ)
    gc.collect()
    gc.freeze()  # the children share the imported modules' pages (fewer copies on write)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the tests; the zygote ends at EOF
    children, cpu = 0, 0.0  # the commands run and their CPU seconds (user + system)
    try:
        while True:
            try:
                ready, _, _ = select.select([req_fd, wake_r], [], [])
            except InterruptedError:  # pragma: no cover  (PEP 475 retries)
                continue
            if wake_r in ready:
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status, ru = os.wait4(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    children, cpu = children + 1, cpu + ru.ru_utime + ru.ru_stime
                    _send(resp_fd, ("exit", pid, os.waitstatus_to_exitcode(status)))
            if req_fd in ready:
                req = _recv(req_fd)
                if req is None:
                    break
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        os.close(req_fd), os.close(resp_fd), os.close(wake_r), os.close(wake_w)
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        signal.signal(signal.SIGINT, signal.default_int_handler)
                        code = _child(req, default_threads, zygote_path)
                    finally:
                        os._exit(code)
                _send(resp_fd, ("started", req["id"], pid))
    except KeyboardInterrupt:  # pragma: no cover
        pass
    log = os.environ.get("CLI_PROCESS_CPU_LOG")  # a file: one line per zygote with its children's CPU
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} commands {children} cpu_s {cpu:.2f}\n")


def _child(req: dict, default_threads: int, zygote_path: list) -> int:
    """In the forked child: become the command (argv, cwd, environment, stdio), run it, return its exit code."""
    import io
    import runpy
    import traceback
    import types

    try:
        for fd, (path, flags) in enumerate(req["stdio"]):
            if path == "=1":
                os.dup2(1, fd)
            elif path is not None:
                f = os.open(path, flags, 0o600)
                os.dup2(f, fd)
                os.close(f)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        enc = os.environ.get("PYTHONIOENCODING", "").split(":")[0] or locale.getpreferredencoding(False)
        errs = "surrogateescape" if enc.replace("-", "").lower() == "utf8" else "strict"
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.open(0, "rb", closefd=False), enc, errs)
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.open(1, "wb", closefd=False), enc, errs)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.open(2, "wb", closefd=False), enc, "backslashreplace", line_buffering=True
        )
        import torch

        torch.set_num_threads(_threads_from_env(os.environ, default_threads))
        kind, target, rest = req["kind"], req["target"], req["rest"]
        # as the interpreter: the script's folder (-m: the working directory, -c: ''), PYTHONPATH, the site's paths
        path0 = {"-m": os.getcwd(), "-c": ""}[kind] if kind != "script" else os.path.dirname(os.path.abspath(target))
        sys.path[:] = [path0] + _pythonpath(os.environ) + [p for p in sys.path[1:] if p not in zygote_path]
        sys.orig_argv = list(req["orig_argv"])
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
    except BaseException:
        traceback.print_exc()
        _flush()
        return 1
    code = 0
    try:
        try:
            if kind == "-m":
                sys.argv = [target, *rest]  # runpy puts the module's file in argv[0]
                for name in (target, target + ".__main__"):  # run as __main__, not the preloaded copy
                    sys.modules.pop(name, None)
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif kind == "-c":
                sys.argv = ["-c", *rest]
                exec(compile(target, "<string>", "exec"), main.__dict__)
            else:
                sys.argv = [target, *rest]
                runpy.run_path(target, run_name="__main__")
        finally:
            _join_threads()
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as the interpreter: die by the signal
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    except BaseException:
        kind_, e, tb = sys.exc_info()
        sys.excepthook(kind_, e.with_traceback(tb.tb_next), tb.tb_next)  # (without this function's frame)
        code = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:  # pragma: no cover
        traceback.print_exc()
    return code if _flush() else 120


def _threads_from_env(env, default: int) -> int:
    """torch's intra-op thread count at start: MKL_NUM_THREADS, else OMP_NUM_THREADS, else the default."""
    n = 0
    for var in _THREAD_ENV:  # the later one wins, as in torch's intraop_default_num_threads
        try:
            v = int(env.get(var, ""))
            if v > 0:
                n = v
        except ValueError:
            pass
    return n or default


def _pythonpath(env) -> list:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _join_threads() -> None:
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()


def _flush() -> bool:
    ok = True
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001  (a closed pipe: the interpreter exits 120)
            ok = False
    return ok


# ---- the test side -----------------------------------------------------------------------------


class _Zygote:
    def __init__(self):
        here = os.path.dirname(os.path.abspath(__file__))
        import fedkernels

        root = os.path.dirname(os.path.dirname(os.path.abspath(fedkernels.__file__)))
        env = {k: v for k, v in _START_ENV.items() if k not in _THREAD_ENV}
        env["PYTHONPATH"] = os.pathsep.join([here, root] + _pythonpath(env))
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import cli_process; cli_process._zygote({req_r}, {resp_w})"],
            pass_fds=(req_r, resp_w),
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=root,
        )
        os.close(req_r), os.close(resp_w)
        self.tmp = tempfile.mkdtemp(prefix="cli-process-")
        self.lock = threading.RLock()
        self.next_id = 0
        self.started = {}  # request id -> pid
        self.exited = {}  # pid -> return code

    def start(self, req: dict) -> int:
        with self.lock:
            req["id"] = self.next_id = self.next_id + 1
            _send(self.req_w, req)
            while req["id"] not in self.started:
                self._pump(None)
            return self.started.pop(req["id"])

    def wait(self, pid: int, deadline):
        """The child's return code, or None when the deadline passes first."""
        with self.lock:
            while pid not in self.exited:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._pump(left)
            return self.exited.pop(pid)

    def _pump(self, timeout):
        ready, _, _ = select.select([self.resp_r], [], [], timeout)
        if not ready:
            return
        msg = _recv(self.resp_r)
        if msg is None:
            raise RuntimeError(f"cli_process: the zygote exited (status {self.proc.wait()}); its error is above")
        if msg[0] == "started":
            self.started[msg[1]] = msg[2]
        else:
            self.exited[msg[1]] = msg[2]

    def close(self):
        try:
            os.close(self.req_w)  # the zygote sees the end of its pipe and exits
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        os.close(self.resp_r)
        shutil.rmtree(self.tmp, ignore_errors=True)


_zygote_lock = threading.Lock()
_the_zygote = None


def _get_zygote() -> _Zygote:
    global _the_zygote
    with _zygote_lock:
        if _the_zygote is None or _the_zygote.proc.poll() is not None:
            _the_zygote = _Zygote()
            atexit.register(_the_zygote.close)
        return _the_zygote


def _parse(cmd):
    """(kind, target, rest) of ``[sys.executable, -m MOD | -c CODE | SCRIPT, args...]``."""
    cmd = [os.fspath(c) for c in cmd]
    if len(cmd) < 2 or cmd[0] != sys.executable:
        raise ValueError(f"cli_process: the command must start with sys.executable, got {cmd[:2]!r}")
    if cmd[1] in ("-m", "-c"):
        if len(cmd) < 3:
            raise ValueError(f"cli_process: {cmd[1]} needs an argument: {cmd!r}")
        return cmd[1], cmd[2], cmd[3:]
    if cmd[1].startswith("-"):
        raise ValueError(
            f"cli_process: interpreter option {cmd[1]!r} is not supported (it acts when Python starts: "
            "use subprocess and a fresh interpreter)"
        )
    return "script", cmd[1], cmd[2:]


def run(
    cmd,
    *,
    cwd=None,
    env=None,
    input=None,
    stdin=None,
    stdout=None,
    stderr=None,
    capture_output=False,
    text=None,
    universal_newlines=None,
    encoding=None,
    errors=None,
    timeout=None,
    check=False,
):
    """``subprocess.run(cmd, ...)`` for ``cmd = [sys.executable, "-m" MOD | "-c" CODE | SCRIPT, *args]``,
    run in a child forked from the zygote (module docstring). Takes subprocess.run's arguments for
    these: cwd, env (default: this process's environment), input, stdin (None or DEVNULL),
    stdout/stderr (None, PIPE, DEVNULL; stderr also STDOUT), capture_output, text/universal_newlines,
    encoding, errors, timeout (the child is killed, TimeoutExpired raised), check."""
    kind, target, rest = _parse(cmd)
    if capture_output:
        if stdout is not None or stderr is not None:
            raise ValueError("stdout and stderr arguments may not be used with capture_output.")
        stdout = stderr = subprocess.PIPE
    if input is not None and stdin is not None:
        raise ValueError("stdin and input arguments may not both be used.")
    for name, v, ok in (
        ("stdin", stdin, (None, subprocess.DEVNULL)),
        ("stdout", stdout, (None, subprocess.PIPE, subprocess.DEVNULL)),
        ("stderr", stderr, (None, subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT)),
    ):
        if v not in ok:
            raise ValueError(f"cli_process.run: {name}={v!r} is not supported (use subprocess)")
    text_mode = bool(text or universal_newlines or encoding or errors)
    z = _get_zygote()
    fd, base = tempfile.mkstemp(dir=z.tmp)
    os.close(fd)
    files = {"in": base + ".in", "out": base + ".out", "err": base + ".err"}
    try:
        W = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if input is not None:
            data = (
                input.encode(encoding or locale.getpreferredencoding(False), errors or "strict") if text_mode else input
            )
            with open(files["in"], "wb") as f:
                f.write(data)
            stdio = [(files["in"], os.O_RDONLY)]
        else:
            stdio = [(os.devnull, os.O_RDONLY)]  # no terminal to read from
        pipes = {subprocess.PIPE: None, subprocess.DEVNULL: (os.devnull, os.O_WRONLY), None: (None, 0)}
        stdio.append(pipes[stdout] or (files["out"], W))
        if stderr == subprocess.STDOUT:
            stdio.append(("=1", 0))  # the child's stderr is a copy of its stdout
        else:
            stdio.append(pipes[stderr] or (files["err"], W))
        env = dict(os.environ if env is None else env)
        req = {
            "kind": kind,
            "target": target,
            "rest": rest,
            "orig_argv": [os.fspath(c) for c in cmd],
            "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
            "env": {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
            "stdio": stdio,
        }
        pid = z.start(req)
        deadline = None if timeout is None else time.monotonic() + timeout
        code = z.wait(pid, deadline)
        timed_out = code is None
        if timed_out:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover
                pass
            z.wait(pid, None)

        def read(which, wanted):
            if wanted != subprocess.PIPE:
                return None
            with open(files[which], "rb") as f:
                data = f.read()
            if text_mode:
                enc = encoding or locale.getpreferredencoding(False)
                data = data.decode(enc, errors or "strict").replace("\r\n", "\n").replace("\r", "\n")
            return data

        out = read("out", stdout)
        err = read("err", stderr if stderr != subprocess.STDOUT else None)
    finally:
        for p in (base, *files.values()):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    p = subprocess.CompletedProcess(cmd, code, out, err)
    if check:
        p.check_returncode()
    return p
