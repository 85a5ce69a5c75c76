"""The build's libstdc++ guard (fedkernels/_toolchain.py, used by setup.py).

A ``$CXX`` wrapper whose search path hides libstdc++.so (as on a GPU image) gives the extension a
private static libstdc++ whose locale is never initialised, and every C++ error message crashes
the process. Here the same compiler is simulated by a wrapper script (it answers
``-print-file-name=libstdc++.so`` with the bare name and links with ``-static-libstdc++``); tiny
shared libraries built both ways check the ELF reader. No extension build (a few seconds in all).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

import fedkernels
from fedkernels import _toolchain as tc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GXX, GCC = tc.SYSTEM_CXX, tc.SYSTEM_CC

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and os.path.isfile(GXX)), reason=f"needs Linux and the system compiler {GXX}"
)

WRAPPER = """#!/bin/sh
# a C++ compiler whose search path has libstdc++.a but not libstdc++.so (the GPU image's $CXX)
for a in "$@"; do
  case "$a" in -print-file-name=libstdc++.so) echo libstdc++.so; exit 0;; esac
done
exec {gxx} -static-libstdc++ "$@"
"""

# formats a long through an ostream, as the csrc/*_checks.h rules do in every error message
SOURCE = """#include <sstream>
#include <string>
extern "C" int fk_format(long v, char* buf, int n) {
  std::ostringstream o; o << "got " << v; std::string s = o.str();
  int k = 0; for (; k + 1 < n && k < (int)s.size(); ++k) buf[k] = s[k]; buf[k] = 0; return k;
}
"""


@pytest.fixture(scope="module")
def bad_cxx(tmp_path_factory):
    path = tmp_path_factory.mktemp("toolchain") / "hidden-libstdcxx-g++"
    path.write_text(WRAPPER.format(gxx=GXX))
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def tiny_libs(bad_cxx, tmp_path_factory):
    """The same tiny C++ shared library linked by the system compiler and by the bad one."""
    d = tmp_path_factory.mktemp("tinyso")
    src = d / "fmt.cpp"
    src.write_text(SOURCE)
    out = {}
    for name, cxx in (("shared", GXX), ("static", bad_cxx)):
        so = d / f"fmt_{name}.so"
        subprocess.run([cxx, "-O1", "-fPIC", "-shared", str(src), "-o", str(so)], check=True, capture_output=True)
        out[name] = str(so)
    return out


def test_probe_tells_the_hidden_libstdcxx_compiler_from_the_system_one(bad_cxx):
    ok, why = tc.probe_shared_libstdcxx(bad_cxx)
    assert not ok and "'libstdc++.so'" in why
    ok, path = tc.probe_shared_libstdcxx(GXX)
    assert ok and os.path.isabs(path) and os.path.basename(path) == "libstdc++.so"
    ok, why = tc.probe_shared_libstdcxx("/nonexistent/g++")
    assert not ok and "cannot be run" in why


def test_guard_keeps_a_good_compiler_untouched():
    assert tc.choose_compiler({"CXX": GXX}) == (GXX, {}, None)
    if tc.probe_shared_libstdcxx("c++")[0]:
        assert tc.choose_compiler({}) == ("c++", {}, None)  # CXX unset: torch uses c++


def test_guard_falls_back_to_the_system_compiler(bad_cxx):
    choice = tc.choose_compiler({"CXX": bad_cxx})
    assert choice.cxx == GXX and choice.env["CXX"] == GXX
    assert choice.env.get("CC") == (GCC if os.path.isfile(GCC) else None)
    assert choice.note is not None and "\n" not in choice.note
    assert f"CXX={bad_cxx}" in choice.note and f"building with CXX={GXX}" in choice.note


@pytest.mark.parametrize("system", ["bad", "missing"])
def test_guard_refuses_when_no_compiler_links_the_shared_libstdcxx(bad_cxx, system):
    fallback = bad_cxx if system == "bad" else "/nonexistent/g++"
    with pytest.raises(tc.ToolchainError) as e:
        tc.choose_compiler({"CXX": bad_cxx}, system=(fallback, GCC))
    msg = str(e.value)
    assert "\n" not in msg and f"CXX={bad_cxx}" in msg and "set CXX (and CC)" in msg and f"CXX={GXX}" in msg


def test_elf_check_tells_a_private_libstdcxx_from_the_shared_one(tiny_libs):
    assert any(n.startswith("libstdc++.so") for n in tc.needed_libraries(tiny_libs["shared"]))
    assert not any(n.startswith("libstdc++.so") for n in tc.needed_libraries(tiny_libs["static"]))
    assert tc.libstdcxx_linkage(tiny_libs["shared"]) == "shared"
    assert tc.libstdcxx_linkage(tiny_libs["static"]) == "static"
    assert tc.check_extension(tiny_libs["shared"], GXX) == "shared"


def test_a_static_build_is_deleted_with_one_line(tiny_libs, tmp_path):
    victim = tmp_path / "_C.so"
    victim.write_bytes(open(tiny_libs["static"], "rb").read())
    with pytest.raises(tc.ToolchainError) as e:
        tc.check_extension(str(victim), "hidden-g++")
    assert "\n" not in str(e.value) and "CXX=hidden-g++" in str(e.value) and "static libstdc++" in str(e.value)
    assert not victim.exists()
    with pytest.raises(ValueError, match="not an ELF file"):
        tc.libstdcxx_linkage(os.path.join(ROOT, "setup.py"))


def test_no_check_off_linux(tiny_libs, monkeypatch):
    monkeypatch.setattr(tc.sys, "platform", "darwin")  # a Mach-O build is not read as ELF (nor refused)
    assert tc.check_extension(os.path.join(ROOT, "setup.py"), "clang++") == "unchecked"
    assert tc.choose_compiler({"CXX": "/nonexistent/clang++"}) == ("/nonexistent/clang++", {}, None)


def test_the_built_extension_uses_the_shared_libstdcxx():
    from fedkernels import _native

    so = _native._C.__file__
    assert tc.libstdcxx_linkage(so) == "shared", f"{so} carries its own libstdc++: rebuild with CXX={GXX}"
    info = fedkernels.build_info()
    assert info["libstdcxx"] == "shared" and "libstdc++.so" in os.path.basename(info["libstdcxx_path"])
    assert info["cxx"] != "unknown" and info["cxx_version"]


def test_a_cpp_error_message_formats_numbers_instead_of_crashing():
    # the crash the guard prevents: `ostream << long` in a TORCH_CHECK message (csrc/<op>_checks.h), run apart
    # so that a SIGSEGV fails this test instead of killing pytest
    code = (
        "import torch, fedkernels\n"
        "try:\n    torch.ops.fedkernels.gc_project_([torch.zeros(2, 3)], 'skip', -7)\n"
        "except RuntimeError as e:\n    print(str(e).splitlines()[0])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert "min_fanin" in r.stdout and "-7" in r.stdout


def test_exports_line_for_shell_scripts(bad_cxx):
    script = os.path.join(ROOT, "fedkernels", "_toolchain.py")

    def run(cxx):
        return subprocess.run(
            [sys.executable, script, "--exports"],
            capture_output=True,
            text=True,
            env={**os.environ, "CXX": cxx},
            timeout=60,
        )

    bad = run(bad_cxx)
    want = f"export CXX={GXX}" + (f" CC={GCC}" if os.path.isfile(GCC) else "")
    assert bad.returncode == 0 and bad.stdout.strip() == want
    assert f"CXX={bad_cxx}" in bad.stderr
    good = run(GXX)
    assert good.returncode == 0 and good.stdout == "" and good.stderr == ""


def test_setup_py_switches_compiler_before_compiling(bad_cxx, tmp_path):
    # the real build command, stopped as soon as the guard has spoken (no extension is built here)
    env = {**os.environ, "CXX": bad_cxx, "MAX_JOBS": "1"}
    cmd = [
        sys.executable,
        "setup.py",
        "build_ext",
        "--build-lib",
        str(tmp_path / "lib"),
        "--build-temp",
        str(tmp_path / "tmp"),
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    seen = ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "fedkernels build:" not in seen and p.poll() is None:
            if select.select([p.stderr], [], [], 1.0)[0]:
                seen += p.stderr.readline()
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    line = next((ln for ln in seen.splitlines() if ln.startswith("fedkernels build:")), "")
    assert f"CXX={bad_cxx}" in line and f"building with CXX={GXX}" in line, seen[-2000:]


def test_gpu_script_exports_the_system_compiler_in_a_dry_run(bad_cxx, tmp_path):
    # bench/gpu.sh build --dry-run runs only the compiler check (no nvcc, no build): the lent GPU's
    # script picks the same compiler setup.py's guard would
    script = os.path.join(ROOT, "bench", "gpu.sh")
    env = {**os.environ, "CXX": bad_cxx, "PY": sys.executable, "OUT": str(tmp_path)}
    r = subprocess.run(["bash", script, "build", "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"using CXX={GXX}" in r.stdout and f"CXX={bad_cxx}" in r.stderr
    r = subprocess.run(["bash", script, "nope"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "usage: bash bench/gpu.sh build-test" in r.stderr
