#!/usr/bin/env bash
# The one script for a lent GPU (H100, torch 2.11+cu130, no package index).
#   bash bench/gpu.sh build-test [--dry-run]   build, then test (below)
#   bash bench/gpu.sh build      header check, compiler check (fedkernels/_toolchain.py: a $CXX that would link
#                                a private static libstdc++ is replaced by /usr/bin/g++ + /usr/bin/gcc), offline
#                                build (TORCH_CUDA_ARCH_LIST=9.0), build_info checks (CUDA, shared libstdc++)
#   bash bench/gpu.sh test       the whole suite with the CUDA build (pytest -n auto when pytest-xdist is
#                                there), then pytest -m cuda, then compute-sanitizer memcheck and racecheck over
#                                every op (bench/gpu.py --sanitize-subset); each step's exit status is kept
#   bash bench/gpu.sh bench [gpu.py args]   bench/gpu.py -> bench/results/gpu-<device>.json (+ $OUT)
#   bash bench/gpu.sh quick [--dry-run]   for a short lease (one command, ~6 min, < 10 min worst case):
#                                build, pytest -m cuda, memcheck only, bench/gpu.py --only (GPU_QUICK_BENCH,
#                                default weighted_sum,gram,kstats,select,codecs,noise,server_opt,min_norm,aggregate), then the overlapped streamed
#                                FedAvg (bench.large_model.gpu_overlap at d = 1e8, K = 16 fp32: 6.4 GB of host RAM)
# build and test are also separate commands: on an H100 machine with 16 cores the build takes 1.5 min and the
# whole suite 5.5 min (pytest -n 16): with the tests and the sanitizer, build-test can exceed a 10-minute limit
# per command; there, run build, then test.
# Logs go to $OUT (when set) or bench/results; test writes bench/results/gpu-tests-<device>.json (+ $OUT):
# per step its exit status, seconds and pass/fail/error/skip counts. Any failure is a non-zero exit.
# GPU_TESTS="tests/test_cuda.py tests/test_lu.py" narrows both pytest steps (default: tests).
# --dry-run (no GPU needed): runs the compiler check, prints the build and sanitizer commands, runs the
# pytest steps with --collect-only and writes the summary to $OUT or a temporary folder (never bench/results).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
step=${1:-}
[ $# -gt 0 ] && shift
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export FORCE_CUDA=1
if [ -z "${CUDA_HOME:-}" ]; then
  if command -v nvcc >/dev/null 2>&1; then
    CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
  else
    CUDA_HOME=/usr/local/cuda
  fi
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
if [ "$DRY" = 1 ]; then
  LOG=${OUT:-$(mktemp -d)}
  RESULTS=$LOG
else
  LOG=${OUT:-bench/results}
  RESULTS=bench/results
fi
mkdir -p "$LOG" "$RESULTS"
STEPS="$LOG/gpu-steps.tsv"   # one line per step: name, exit status, seconds, log, junit file

run() {  # prints a command; runs it unless --dry-run
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

record() {  # name rc seconds log [junit]
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$STEPS"
}

header_check() {  # every failure returns 1 (set -e does not act inside a function called from a condition)
  echo "== header check (CUDA_HOME=$CUDA_HOME)"
  command -v nvcc >/dev/null || { echo "nvcc not found (CUDA_HOME=$CUDA_HOME)"; return 1; }
  nvcc --version | tail -2
  local inc tmp std rc=0
  inc=$("$PY" -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))") \
    || return 1
  std=$("$PY" -c "import torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); print('c++20' if v >= (2, 14) else 'c++17')") \
    || return 1
  tmp=$(mktemp -d)
  printf '#include <c10/cuda/CUDAStream.h>\n#include <cuda_runtime_api.h>\n#include <cuda_bf16.h>\nint main() { return 0; }\n' >"$tmp/h.cpp"
  # the glue needs only these; ATen/cuda/CUDAContext.h (cuBLAS/cuSPARSE headers) is never included
  # shellcheck disable=SC2086  # $inc is a list of -I flags
  g++ -std="$std" -fsyntax-only $inc -I"$CUDA_HOME/include" "$tmp/h.cpp" || rc=1
  rm -rf "$tmp"
  if [ "$rc" = 0 ]; then echo "headers ok ($std)"; else echo "HEADER CHECK FAILED"; fi
  return "$rc"
}

choose_compiler() {
  # setup.py applies the same guard; exporting here makes the header check and the log say which compiler
  local exports
  echo "== C++ compiler (CXX=${CXX:-unset})"
  exports=$("$PY" fedkernels/_toolchain.py --exports) || return 2
  if [ -n "$exports" ]; then
    echo "$exports"
    eval "$exports"
  fi
  echo "using CXX=${CXX:-c++}"
}

build() {
  echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, offline)"
  local t0=$SECONDS rc=0
  choose_compiler || { record build 2 $((SECONDS - t0)) "-"; return 2; }
  if [ "$DRY" = 0 ]; then header_check || { record build 1 $((SECONDS - t0)) "-"; return 1; }; fi
  echo "+ MAX_JOBS=${MAX_JOBS:-16} timeout 300 $PY -m pip install -v --no-build-isolation --no-deps --no-index -e . >$LOG/build.log"
  if [ "$DRY" = 0 ]; then
    MAX_JOBS=${MAX_JOBS:-16} timeout 300 "$PY" -m pip install -v --no-build-isolation --no-deps --no-index -e . \
      >"$LOG/build.log" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
      tail -40 "$LOG/build.log"; echo "BUILD FAILED (exit $rc)"
      record build "$rc" $((SECONDS - t0)) "$LOG/build.log"; return 1
    fi
    grep -h "fedkernels build:" "$LOG/build.log" || true   # the guard's line, when it switched compilers
    echo "built in $((SECONDS - t0)) s"
    "$PY" - <<'PY' || rc=$?
import json, torch, fedkernels
info = fedkernels.build_info()
print("build_info:", json.dumps(info))
assert info["cuda"], "the extension was built without CUDA"
assert info["libstdcxx"] == "shared", f"the extension carries its own libstdc++ ({info['libstdcxx_path']})"
assert torch.cuda.is_available(), "no CUDA device visible"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)
names = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fedkernels::")})
missing = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA")]
print(len(names), "fedkernels ops, all with a CUDA kernel" if names and not missing else "")
assert names and not missing, f"ops without a CUDA kernel: {missing}"
PY
  fi
  record build "$rc" $((SECONDS - t0)) "$LOG/build.log"
  return "$rc"
}

pytest_step() {  # name timeout_s pytest-args...
  local name=$1 limit=$2 t0=$SECONDS rc=0
  shift 2
  local args=(-q -p no:cacheprovider --junitxml="$LOG/junit-$name.xml" "$@")
  if [ "$DRY" = 1 ]; then args+=(--collect-only); fi
  echo "== tests: $name (pytest ${*:-})"
  echo "+ timeout $limit $PY -m pytest ${args[*]} >$LOG/tests-$name.log"
  timeout "$limit" "$PY" -m pytest "${args[@]}" >"$LOG/tests-$name.log" 2>&1 || rc=$?
  tail -25 "$LOG/tests-$name.log"
  echo "$name: exit $rc in $((SECONDS - t0)) s"
  record "$name" "$rc" $((SECONDS - t0)) "$LOG/tests-$name.log" "$LOG/junit-$name.xml"
  return "$rc"
}

sanitize() {  # [tools...] (default: memcheck racecheck)
  local tools=("$@")
  [ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck)
  echo "== compute-sanitizer (${tools[*]}) over bench/gpu.py --sanitize-subset"
  local san tool t0 rc all=0
  san=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
  for tool in "${tools[@]}"; do
    t0=$SECONDS rc=0
    echo "+ timeout 150 $san --tool $tool --error-exitcode 3 $PY bench/gpu.py --sanitize-subset >$LOG/sanitizer-$tool.log"
    if [ "$DRY" = 0 ]; then
      timeout 150 "$san" --tool "$tool" --error-exitcode 3 "$PY" bench/gpu.py --sanitize-subset \
        >"$LOG/sanitizer-$tool.log" 2>&1 || { rc=$?; tail -30 "$LOG/sanitizer-$tool.log"; echo "SANITIZER $tool FAILED"; }
      tail -3 "$LOG/sanitizer-$tool.log"
    fi
    record "sanitizer-$tool" "$rc" $((SECONDS - t0)) "$LOG/sanitizer-$tool.log"
    [ "$rc" = 0 ] || all=1
  done
  return "$all"
}

summary() {  # -> $RESULTS/gpu-tests-<device>.json (+ $OUT); exit 0 when every recorded step passed
  STEPS="$STEPS" RESULTS="$RESULTS" DRY="$DRY" "$PY" - <<'PY'
import json, os, platform, subprocess, sys
import xml.etree.ElementTree as ET

def counts(junit):
    """pass/fail/error/skip counts of a pytest junit file (None when pytest wrote none: it crashed)."""
    if not junit or not os.path.isfile(junit):
        return None
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    return c

steps = {}
for line in open(os.environ["STEPS"]):
    name, rc, secs, log, junit = line.rstrip("\n").split("\t")
    steps[name] = {"exit": int(rc), "seconds": int(secs), "log": log}
    if junit:
        steps[name]["counts"] = counts(junit)
try:
    import torch
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu-{platform.machine()}"
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
except Exception as e:  # report what is known rather than nothing
    dev, versions = "unknown", {"torch_error": str(e)}
try:
    import fedkernels
    info = fedkernels.build_info()
except Exception as e:
    info = {"error": str(e)}
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
doc = {"device": dev, **versions, "build_info": info, "commit": commit, "dry_run": os.environ["DRY"] == "1",
       "ok": bool(steps) and all(s["exit"] == 0 for s in steps.values()), "steps": steps}
slug = "".join(c if c.isalnum() else "-" for c in dev).strip("-").lower()   # as bench/gpu.py names its file
paths = [os.path.join(os.environ["RESULTS"], f"gpu-tests-{slug}.json")]
if os.environ.get("OUT") and os.path.abspath(os.environ["OUT"]) != os.path.abspath(os.environ["RESULTS"]):
    paths.append(os.path.join(os.environ["OUT"], f"gpu-tests-{slug}.json"))
for p in paths:
    with open(p, "w") as f:
        json.dump(doc, f, indent=1)
for name, s in steps.items():
    c = s.get("counts")
    shown = "" if c is None else f"  {c['passed']} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped"
    print(f"{name:20s} exit {s['exit']:3d} {s['seconds']:5d} s{shown}")
print("wrote", ", ".join(paths))
sys.exit(0 if doc["ok"] else 1)
PY
}

tests() {
  local rc=0 xdist=() sel=()
  if "$PY" -c "import xdist" >/dev/null 2>&1; then xdist=(-n auto); fi
  read -r -a sel <<<"${GPU_TESTS:-tests}"
  pytest_step suite 420 ${xdist[@]+"${xdist[@]}"} "${sel[@]}" || rc=1
  pytest_step cuda 240 -m cuda "${sel[@]}" || rc=1
  sanitize || rc=1
  return "$rc"
}

case "$step" in
  build-test)
    t0=$SECONDS
    : >"$STEPS"
    rc=0
    if build; then tests || rc=1; else rc=1; fi
    summary || rc=1
    echo "build-test done in $((SECONDS - t0)) s, exit $rc"
    exit $rc
    ;;
  build)
    : >"$STEPS"
    rc=0
    build || rc=$?
    exit $rc
    ;;
  test)
    : >"$STEPS"
    rc=0
    tests || rc=1
    summary || rc=1
    exit $rc
    ;;
  quick)
    t0=$SECONDS
    : >"$STEPS"
    rc=0
    if build; then
      pytest_step cuda 150 -m cuda tests || rc=1
      sanitize memcheck || rc=1
      echo "+ timeout 150 $PY bench/gpu.py --out $RESULTS --only ${GPU_QUICK_BENCH:-weighted_sum,gram,kstats,select,codecs,noise,server_opt,min_norm,aggregate}"
      if [ "$DRY" = 0 ]; then
        b0=$SECONDS brc=0
        timeout 150 "$PY" bench/gpu.py --out "$RESULTS" --only "${GPU_QUICK_BENCH:-weighted_sum,gram,kstats,select,codecs,noise,server_opt,min_norm,aggregate}" \
          >"$LOG/bench.log" 2>&1 || brc=$?
        tail -40 "$LOG/bench.log"
        record bench "$brc" $((SECONDS - b0)) "$LOG/bench.log"
        [ "$brc" = 0 ] || rc=1
        b0=$SECONDS brc=0
        timeout 90 "$PY" -c "from bench.large_model import gpu_overlap; gpu_overlap(d=100_000_000, out='$RESULTS')" \
          >"$LOG/overlap.log" 2>&1 || brc=$?
        tail -15 "$LOG/overlap.log"
        record overlap "$brc" $((SECONDS - b0)) "$LOG/overlap.log"
        [ "$brc" = 0 ] || rc=1
      fi
    else
      rc=1
    fi
    summary || rc=1
    echo "quick done in $((SECONDS - t0)) s, exit $rc"
    exit $rc
    ;;
  bench)
    echo "== benchmarks"
    timeout 470 "$PY" bench/gpu.py --out bench/results "$@"     # the published results (a later --out wins)
    ;;
  *)
    echo "usage: bash bench/gpu.sh build-test [--dry-run] | build [--dry-run] | test [--dry-run] | quick [--dry-run] | bench [bench/gpu.py args]" >&2
    exit 2
    ;;
esac
