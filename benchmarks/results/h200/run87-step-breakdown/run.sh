#!/bin/bash
# Where a W4A16 decode step's time goes with PDL off (each kernel's own interval):
# `w4a16_step_kernels.py --pdl 0` at 1-256 rows, per kernel and per layer in launch order.
# Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python benchmarks/w4a16_step_kernels.py --m 64 256 16 1 128 --pdl 0 \
  --out $OUT/step_kernels_pdl0.json 2>&1 | grep -v Warn > $OUT/step_kernels_pdl0.log
grep -vE "^ +_warn|UserWarning" $OUT/step_kernels_pdl0.log | head -120
echo "done in $SECONDS s"
