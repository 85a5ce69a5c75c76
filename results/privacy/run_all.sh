#!/bin/bash
# Fashion-MNIST privacy-utility sweep (results/privacy): eps in {1,2,4,8} at delta=1e-5 and non-private,
# 3 seeds, FedAvg, FedAvgM, FedProx under central DP (clip 1.0).
cd "$(dirname "$0")/../.."          # the repository root
PY=${PYTHON:-python}
mkdir -p runs/privacy
M="fedavg,fedavgm:beta=0.5,fedprox:mu=0.01"
for E in ${LEVELS:-nonprivate 8 4 2 1}; do
  if [ "$E" = nonprivate ]; then DP=""; else DP="dp.kind=central dp.clip=1.0 dp.delta=0.00001 dp.target_epsilon=$E"; fi
  nice -n 10 $PY -m fedkernels.sim.cli compare results/privacy/base.yaml $DP out_dir=runs/privacy/runs \
     --methods $M --seeds 0,1,2 --out runs/privacy/compare-$E --no-progress --quiet > runs/privacy/log-$E.txt 2>&1
  echo "$E rc=$? $(date -u)" >> runs/privacy/done.txt
done
