#!/bin/sh
# The robustness grid in the background, niced (the machine is shared): see run_grid.py.
cd "$(dirname "$0")/../.." && export PYTHONPATH=$PWD && \
  nohup nice -n 15 "${PYTHON:-python3}" results/robust/run_grid.py --out runs/robust "$@" \
  > runs/robust_grid.log 2>&1 &
