#!/bin/bash
# The GPU tests of the 8-bit path's quantization and GEMMs (the one-pass row quantization
# compiled for the GPU), then on an H100 run 78 (PDL per kernel at 160-256 rows), on an H200
# run 71 (the #13 figures the targets are set for) in the time left. Writes $OUT/run79.tgz
# (and run78.tgz or run71.tgz).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run79 && mkdir -p $O
trap 'tar czf $OUT/run79.tgz -C /tmp run79' EXIT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt)
echo "$gpu"
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_scaled_mm.py \
  tests/kernels/test_fused_ops.py -m "gpu or not slow" -rf 2>&1 \
  | grep -E "FAILED|passed|failed" | cut -c1-300 > $O/tests.log
tail -3 $O/tests.log
if [[ $gpu == *H200* ]]; then
  LIMIT=$((570 - SECONDS)) OUT=$OUT bash benchmarks/results/h200/run71-next/run.sh
else
  OUT=$OUT bash benchmarks/results/h200/run78-pdl-parts/run.sh
fi
echo "done in $SECONDS s"
