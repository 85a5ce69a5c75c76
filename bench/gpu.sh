#!/usr/bin/env bash
# The one script to run on a lent GPU (H100): build the CUDA extension in place, run the CUDA tests,
# then the GPU benchmarks (bench/gpu.py -> bench/results/gpu-<device>.json, copied to $OUT if set).
# Usage: bash bench/gpu.sh [--quick] [--skip-tests]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export FORCE_CUDA=1
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); export CUDA_HOME
fi
LOG=${OUT:-bench/results}
mkdir -p "$LOG"
skip_tests=0
args=()
for a in "$@"; do
  if [ "$a" = "--skip-tests" ]; then skip_tests=1; else args+=("$a"); fi
done

echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, CUDA_HOME=${CUDA_HOME:-unset})"
t0=$(date +%s)
if ! $PY -m pip install --no-build-isolation --no-deps --no-index -e . >"$LOG/build.log" 2>&1; then
  tail -40 "$LOG/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
$PY - <<'PY' || exit 1
import json, torch, fedkernels
info = fedkernels.build_info()
print("build_info:", json.dumps(info))
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
assert info["cuda"], "the extension was built without CUDA"
PY

if [ $skip_tests = 0 ]; then
  echo "== tests (pytest -m cuda)"
  $PY -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider 2>&1 | tee "$LOG/test_cuda.log" | tail -25
fi

echo "== benchmarks"
$PY bench/gpu.py "${args[@]}"
