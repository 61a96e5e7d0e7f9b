#!/bin/bash
# The wgmma kernel with one A buffer and two CTAs a SM (ncu: 1-2 warps a scheduler, 6.5 cycles
# an instruction): its tests, the sweep at 64-1024 rows; then run4.sh (the rule's steps,
# workload a AWQ against bf16) as time allows (LIMIT seconds). Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-580}
timeout 60 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py -k "tile_shape" -rf 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $OUT/tests.log; tail -2 $OUT/tests.log
timeout 90 python $B/w4a16_skinny_bench.py --m 64 128 256 1024 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -6 $OUT/sweep.log
LIMIT=$((LIMIT - SECONDS)) bash $B/results/h200/run37-w4a16-wgmma/run4.sh
