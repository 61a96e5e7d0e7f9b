#!/bin/bash
# The W4A16 GEMV's consumers loading their first K step's scales and zero points before the
# PDL wait (`GemvConfig.sc_early`, PAGODA_W4A16_SC_EARLY): its GPU tests (every launch shape,
# PDL chains in graphs), whole steps at 1-16 rows against the rule (the step bench's
# variants, in turn twice), then single-stream AWQ decode with the flag 1 and 0, where a GEMV
# follows a short kernel and what it waits for after the PDL wait is on the critical path.
# Parts that would not finish within LIMIT seconds are skipped. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-400}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_gemv.py \
  -k "every_launch or pdl_chain or graph" -rf 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-400 | tee $OUT/tests.log
left 50 "sc_early steps" && timeout 50 python $B/w4a16_skinny_bench.py --step --m 1 4 8 16 \
  --reps 5 --gemv-variants rule sc_early=1 > $OUT/step_sc_early.log 2>&1
tail -5 $OUT/step_sc_early.log
for s in 1 0; do
  left 45 "b awq sc_early=$s" || continue
  PAGODA_W4A16_SC_EARLY=$s OUT=/tmp/b timeout 70 python $B/h200_bench.py --only b \
    --quantization awq > $OUT/b_awq_sc_early$s.log 2>&1
  echo "b awq sc_early=$s: $(grep -E '^b Pagoda decode tok/s' $OUT/b_awq_sc_early$s.log | tr -s ' ')"
done
echo "done in $SECONDS s"
