#!/bin/bash
# The GEMV ring's copy pattern alone against a plain read and the GEMV (ring_copy.py), then
# run 94's pending check (the fused SiLU-and-mul GEMV with the scale prefetch: GPU tests, steps).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
D=benchmarks/results/h200/run95-ring-copy
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python $D/ring_copy.py 2>&1 | grep -v Warn | tee $OUT/ring_copy.log
bash benchmarks/results/h200/run94-sc-prefetch/check.sh
echo "done in $SECONDS s"
