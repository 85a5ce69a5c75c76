#!/usr/bin/env bash
# Packaging check: `python -m build` makes the sdist and then a wheel FROM the unpacked sdist (so a
# file missing from MANIFEST.in fails here); the wheel is installed into a fresh venv (torch first,
# pinned to the building torch, then the wheel with its dependencies) and smoke-tested from outside
# the checkout. The wheel is the portable build (FEDKERNELS_MARCH, default x86-64-v2, with runtime
# dispatch of the hot loops to AVX2/AVX-512). About 3-4 minutes on 2 cores (compile + torch install).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PYBIN=${PYBIN:-$repo/.venv/bin/python}
export FEDKERNELS_MARCH=${FEDKERNELS_MARCH:-x86-64-v2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== python -m build --no-isolation (sdist, then a wheel from it; -march=$FEDKERNELS_MARCH)"
"$PYBIN" -m build --no-isolation -o "$work/dist" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
ls -l "$work/dist"
sdist=$(ls "$work"/dist/fedkernels-*.tar.gz)
wheel=$(ls "$work"/dist/fedkernels-*.whl)

# every source file under csrc/ (and the licence, the typing marker) is in the sdist
"$PYBIN" - "$sdist" <<'PY'
import os, sys, tarfile
names = {n.split("/", 1)[1] for n in tarfile.open(sys.argv[1]).getnames() if "/" in n}
wanted = ["LICENSE", "fedkernels/py.typed"] + [
    os.path.join(dp, f) for dp, _, fs in os.walk("csrc") for f in fs if f.endswith((".h", ".cuh", ".cu", ".cpp"))]
missing = [f for f in wanted if f not in names]
assert len(wanted) > 2 and not missing, f"sdist lacks {missing}"
print(f"sdist holds all {len(wanted)} source/licence/typing files")
PY

torch_req=$("$PYBIN" -c "import torch; print('torch==' + torch.__version__.split('+')[0])")
echo "== fresh venv: $torch_req, then the wheel"
"$PYBIN" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$torch_req"
"$work/venv/bin/python" -m pip install -q "$wheel"
cd "$work"
EXPECT_MARCH="$FEDKERNELS_MARCH" "$work/venv/bin/python" "$repo/.ci/wheel_smoke.py"
