#!/bin/bash
# The W4A16 GEMV's consumers loading their first K step's scales and zero points before the
# PDL wait (`GemvConfig.sc_early`, PAGODA_W4A16_SC_EARLY): its GPU tests (every launch shape,
# PDL chains in graphs), whole steps at 1-16 rows against the rule (the step bench's
# variants, in turn twice), then single-stream AWQ decode with the flag 1 and 0, where a GEMV
# follows a short kernel and what it waits for after the PDL wait is on the critical path.
# On an H200 also #13's table (W4A16 steps at 1-256 rows, bf16 single stream, W8A8 / FP8).
# Parts that would not finish within LIMIT seconds are skipped. Writes to $OUT (the device
# tool returns at most 8 files: the figures are also printed).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
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
if grep -q H200 $OUT/gpu.txt; then  # #13's table on the GPU it names: W4A16, bf16, W8A8 / FP8
  left 80 "w4a16 steps" && timeout 75 python $B/w4a16_skinny_bench.py --step \
    --m 1 16 64 128 256 --reps 5 > $OUT/w4a16_step.log 2>&1
  tail -7 $OUT/w4a16_step.log
  left 60 "b bf16" && OUT=/tmp/b timeout 60 python $B/h200_bench.py --only b > $OUT/b_bf16.log 2>&1
  echo "b bf16: $(grep -E '^b Pagoda decode tok/s' $OUT/b_bf16.log | tr -s ' ')"
  left 80 "w8a8 table" && timeout 75 python $B/w8a8_bench.py --m 1,64,128,256,1024 \
    2>&1 | grep -v Warn > $OUT/w8a8.log
  grep -E "^ +[0-9]+ \|" $OUT/w8a8.log | cut -c1-200
fi
echo "done in $SECONDS s"
