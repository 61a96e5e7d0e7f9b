#!/bin/bash
# The wgmma kernel reading x pre-tiled (`tile_x`: one contiguous copy a tile, 224 instead of
# 438 instructions a K step): the GPU tests of both CUDA W4A16 kernels, the sweep at 32-1024
# rows, whole decode steps. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py \
  tests/kernels/test_w4a16_gemv.py -x -rf 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-400 > $OUT/tests.log; tail -3 $OUT/tests.log
timeout 150 python $B/w4a16_skinny_bench.py --m 32 64 128 256 1024 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -8 $OUT/sweep.log
timeout 90 python $B/w4a16_skinny_bench.py --step --m 1 16 64 128 256 1024 --reps 5 > $OUT/step.log 2>&1
tail -7 $OUT/step.log
echo "done in $SECONDS s"
