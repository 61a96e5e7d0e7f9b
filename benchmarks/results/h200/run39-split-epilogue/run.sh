#!/bin/bash
# The split-K sum by the last CTA element by element (no spills with 256-row tiles): the
# split, tile and graph tests, the wgmma sweep at 256 and 512 rows (256-row tiles for every
# layer), then whole decode steps with the rule of this commit at 1-1024 rows. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py \
  -k "split or tile_shape or graph or larger_groups" -rf > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log | cut -c1-300
timeout 150 python $B/w4a16_skinny_bench.py --m 256 512 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -12 $OUT/sweep.log
timeout 100 python $B/w4a16_skinny_bench.py --step --m 1 16 64 128 256 512 1024 --reps 5 \
  > $OUT/step.log 2>&1
tail -9 $OUT/step.log
echo "done in $SECONDS s"
