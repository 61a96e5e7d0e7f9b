#!/bin/bash
# The W4A16 GEMV with CTAs that take tiles in turn (GemvConfig.persistent, CTAs an SM): its GPU
# tests, then whole decode steps at 1 and 16 rows with the rule's configs as they are, with
# persistent=2 and 3 set in each, and 2 with a third stage (w4a16_skinny_bench.py --step
# --gemv-variants).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_gemv.py \
  -k "tiles_in_turn or pdl_chain or replays" -rf 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-300 | tee $OUT/tests.log
grep -q failed $OUT/tests.log && exit 1
timeout ${STEP_S:-240} python benchmarks/w4a16_skinny_bench.py --step --m 1 16 --reps 5 \
  --gemv-variants rule persistent=2 persistent=3 persistent=2,stages=3 > $OUT/step.log 2>&1
tail -7 $OUT/step.log
echo "done in $SECONDS s"
