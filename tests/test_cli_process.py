"""tests/cli_process.py (the CLI tests' forked children) behaves as ``subprocess.run`` of a fresh
interpreter where the tests rely on it: exit codes, tracebacks, stdio, argv, sys.path, working
directory, environment, torch's thread count, timeouts, atexit handlers and threads at exit."""

import os
import subprocess
import sys
import textwrap

import pytest

import cli_process  # tests/cli_process.py

PY = sys.executable
# what a child reports about itself
PROBE = textwrap.dedent(
    """
    import json, os, sys, torch
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "x": os.environ.get("PROBE_X"),
                      "threads": torch.get_num_threads(), "main": __name__, "stdin": sys.stdin.read()}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("PROBE_CODE", "0")))
    """
)


def _both(cmd, **kw):
    """The same command through subprocess (a fresh interpreter) and through cli_process."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw), cli_process.run(
        cmd, capture_output=True, text=True, timeout=120, **kw
    )


def test_a_script_sees_what_a_fresh_interpreter_sees(tmp_path):
    """argv, sys.path[0], the working directory, the environment, stdin, the exit code and torch's default
    thread count (no OMP_NUM_THREADS / MKL_NUM_THREADS): the same as in a fresh interpreter."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(PROBE_X="x1", PROBE_CODE="3")
    fresh, forked = _both([PY, str(script), "a", "b c"], cwd=tmp_path, env=env, input="from stdin")
    assert fresh.returncode == forked.returncode == 3, (fresh.stderr, forked.stderr)
    assert fresh.stdout == forked.stdout and fresh.stderr == forked.stderr == "to stderr\n"
    assert '"argv": ["' + str(script) + '", "a", "b c"]' in forked.stdout and '"stdin": "from stdin"' in forked.stdout


def test_dash_c_and_dash_m(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = cli_process.run([PY, "-c", PROBE, "z"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert '"argv": ["-c", "z"], "path0": ""' in p.stdout and f'"cwd": "{tmp_path}"' in p.stdout
    assert '"threads": 2' in p.stdout and '"main": "__main__"' in p.stdout
    (tmp_path / "probe_mod.py").write_text(PROBE)
    p = cli_process.run([PY, "-m", "probe_mod", "y"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert f'"argv": ["{tmp_path / "probe_mod.py"}", "y"], "path0": "{tmp_path}"' in p.stdout
    # the CLI itself, as `python -m fedkernels` runs it: its usage error and exit 2
    fresh, forked = _both([PY, "-m", "fedkernels", "run", "--no-such-option"])
    assert (
        fresh.returncode == forked.returncode == 2
        and fresh.stderr == forked.stderr
        and "usage: fedkernels" in forked.stderr
    )


@pytest.mark.parametrize(
    "code,rc,err",
    [
        ("raise SystemExit", 0, ""),
        ("raise SystemExit('bye')", 1, "bye\n"),
        ("raise SystemExit(258)", 2, ""),
        (
            "raise ValueError('boom')",
            1,
            'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\nValueError: boom\n',
        ),
        ("raise KeyboardInterrupt", -2, None),
        ("import atexit, sys; atexit.register(lambda: print('atexit', file=sys.stderr))", 0, "atexit\n"),
        (
            "import threading, time, sys; threading.Thread(target=lambda: (time.sleep(0.2), print('joined', file=sys.stderr))).start()",
            0,
            "joined\n",
        ),
    ],
)
def test_exit_codes_and_stderr(code, rc, err):
    p = cli_process.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == rc, p
    if err is not None:
        assert p.stderr == err, p.stderr


def test_output_modes_and_timeout(tmp_path):
    code = "import sys; print('out'); sys.stdout.flush(); print('err', file=sys.stderr)"
    p = cli_process.run([PY, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert (p.stdout, p.stderr) == (b"out\nerr\n", None)
    p = cli_process.run([PY, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert (p.stdout, p.stderr) == (None, "err\n")
    with pytest.raises(subprocess.CalledProcessError):
        cli_process.run([PY, "-c", "raise SystemExit(4)"], check=True)
    with pytest.raises(subprocess.TimeoutExpired) as e:
        cli_process.run(
            [PY, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
            capture_output=True,
            text=True,
            timeout=5,  # long enough for a loaded machine to print the pid before the timeout
        )
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(int(e.value.output), 0)
    with pytest.raises(ValueError, match="interpreter option '-X'"):
        cli_process.run([PY, "-X", "importtime", "-c", "pass"])
