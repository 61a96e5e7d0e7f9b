#!/bin/bash
# The server on the GPU and where a W4A16 decode step's time goes, in one call: run 83's check
# (the GPU tests outside the kernels, `pagoda serve` on CUDA with bf16 and AWQ dummy weights,
# then the kernels' GPU tests as time allows) with LIMIT - 150 seconds, then
# `w4a16_step_kernels.py` (each kernel's time a step, and the step's wall time against their
# sum) at 64, 256, 1, 128 and 16 rows, in that order. Needs the wheels of
# benchmarks/gpu_wheelhouse.sh carried as .whl. Writes $OUT/run83.tgz and
# $OUT/step_kernels.{log,json}.
cd "$(dirname "$0")/../../../.." || exit 1
LIMIT=${LIMIT:-560}
LIMIT=$((LIMIT - 150)) bash benchmarks/results/h200/run83-gpu-check/run.sh
export PYTHONUNBUFFERED=1
timeout $((LIMIT - SECONDS - 5)) python benchmarks/w4a16_step_kernels.py --m 64 256 1 128 16 \
  --out $OUT/step_kernels.json > $OUT/step_kernels.log 2>&1
grep -E "^(w4a16|bf16) M=" $OUT/step_kernels.log
echo "done in $SECONDS s"
