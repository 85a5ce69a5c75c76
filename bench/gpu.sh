#!/usr/bin/env bash
# The one script for a lent GPU (H100, torch 2.11+cu130, no package index). Two steps, each < 8 min:
#   bash bench/gpu.sh build-test   offline build (TORCH_CUDA_ARCH_LIST=9.0), header check first,
#                                  pytest -m cuda (exit status kept), compute-sanitizer memcheck and
#                                  racecheck over every op on small shapes (bench/gpu.py --sanitize-subset)
#   bash bench/gpu.sh bench [gpu.py args]   bench/gpu.py -> bench/results/gpu-<device>.json (+ $OUT)
# Logs go to $OUT (when set) or bench/results. Any failure is a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
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
LOG=${OUT:-bench/results}
mkdir -p "$LOG"
step=${1:-}
[ $# -gt 0 ] && shift

header_check() {
  echo "== header check (CUDA_HOME=$CUDA_HOME)"
  command -v nvcc >/dev/null || { echo "nvcc not found (CUDA_HOME=$CUDA_HOME)"; exit 1; }
  nvcc --version | tail -2
  local inc tmp
  inc=$($PY -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))")
  tmp=$(mktemp -d)
  printf '#include <c10/cuda/CUDAStream.h>\n#include <cuda_runtime_api.h>\n#include <cuda_bf16.h>\nint main() { return 0; }\n' >"$tmp/h.cpp"
  # the glue needs only these; ATen/cuda/CUDAContext.h (cuBLAS/cuSPARSE headers) is never included
  local std
  std=$($PY -c "import torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); print('c++20' if v >= (2, 14) else 'c++17')")
  g++ -std="$std" -fsyntax-only $inc -I"$CUDA_HOME/include" "$tmp/h.cpp"
  rm -rf "$tmp"
  echo "headers ok ($std)"
}

build() {
  echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, offline)"
  local t0=$SECONDS
  if ! MAX_JOBS=${MAX_JOBS:-16} timeout 300 $PY -m pip install --no-build-isolation --no-deps --no-index -e . \
      >"$LOG/build.log" 2>&1; then
    tail -40 "$LOG/build.log"; echo "BUILD FAILED"; exit 1
  fi
  echo "built in $((SECONDS - t0)) s"
  $PY - <<'PY'
import json, torch, fedkernels
info = fedkernels.build_info()
print("build_info:", json.dumps(info))
assert info["cuda"], "the extension was built without CUDA"
assert torch.cuda.is_available(), "no CUDA device visible"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)
names = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fedkernels::")})
missing = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA")]
print(len(names), "fedkernels ops, all with a CUDA kernel" if names and not missing else "")
assert names and not missing, f"ops without a CUDA kernel: {missing}"
PY
}

case "$step" in
  build-test)
    t0=$SECONDS
    header_check
    build
    echo "== tests (pytest -m cuda)"
    rc=0
    timeout 240 $PY -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider 2>&1 | tee "$LOG/test_cuda.log" | tail -25 \
      || rc=$?
    echo "== compute-sanitizer (memcheck, racecheck) over bench/gpu.py --sanitize-subset"
    san=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
    for tool in memcheck racecheck; do
      timeout 150 "$san" --tool "$tool" --error-exitcode 3 $PY bench/gpu.py --sanitize-subset \
        >"$LOG/sanitizer-$tool.log" 2>&1 || { tail -30 "$LOG/sanitizer-$tool.log"; echo "SANITIZER $tool FAILED"; rc=1; }
      tail -3 "$LOG/sanitizer-$tool.log"
    done
    echo "build-test done in $((SECONDS - t0)) s, exit $rc"
    exit $rc
    ;;
  bench)
    echo "== benchmarks"
    timeout 470 $PY bench/gpu.py "$@"
    ;;
  *)
    echo "usage: bash bench/gpu.sh build-test | bench [bench/gpu.py args]" >&2
    exit 2
    ;;
esac
