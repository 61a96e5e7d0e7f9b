#!/bin/bash
# The split-K sum by the last CTA element by element (no spills with 256-row tiles): the
# split, tile and graph tests, then the wgmma sweep at 256 rows. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py \
  -k "split or tile_shape or graph or larger_groups" -rf > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log | cut -c1-300
timeout 70 python $B/w4a16_skinny_bench.py --m 256 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; grep -E "^(qkv|o |gate|down)|^  256" $OUT/sweep.log
echo "done in $SECONDS s"
