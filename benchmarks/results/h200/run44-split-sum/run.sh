#!/bin/bash
# The split-K sums with their loads in flight together: the wgmma kernel's (8
# outputs a thread, up to 4 splits; it paid a load latency per split and output) and the
# Triton kernels' (`skinny_gemm.sum_splits`: 4 splits at a time; the few-row W4A16 kernel
# splits 8 ways at 17-32 rows). Their GPU tests; whole steps at 17-512 rows (compare with run
# 41 on an H100, run 42's h200-baseline on an H200); the wgmma sweep at 64-256 rows (256-row
# tiles split 2 and 4 ways, the rule's configs split 1-6 ways: splits, and 256-row tiles for
# the narrow layers, which the old sum made slow, may win now); workload a AWQ against bf16;
# the Triton few-row sweep at 16 and 32 rows (run 34 on an H200: o at 32 rows 13.1 us split 8
# ways, 18.6 split 16). Steps that would not finish within LIMIT seconds (560 by default) are
# skipped. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py \
  tests/kernels/test_skinny_gemm.py tests/kernels/test_scaled_mm.py tests/kernels/test_w8a16.py \
  -rf 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $OUT/tests.log
tail -4 $OUT/tests.log
left 60 step && timeout 70 python $B/w4a16_skinny_bench.py --step \
  --m 17 24 32 48 64 96 128 160 192 256 512 --reps 5 > $OUT/step.log 2>&1; tail -12 $OUT/step.log
left 200 sweep && timeout 180 python $B/w4a16_skinny_bench.py --m 64 128 192 256 --no-sweep \
  --no-cuda-sweep --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1
[ -s $OUT/sweep.json ] && python $B/w4a16_skinny_bench.py --top 3 --family wgmma --out $OUT/sweep.json
for q in awq none; do
  left 100 "workload a $q" || continue
  args=(--only a); [ $q = awq ] && args+=(--quantization awq)
  OUT=/tmp/a_$q timeout 95 python $B/h200_bench.py "${args[@]}" --time-budget 85 > $OUT/a_$q.log 2>&1
  cp /tmp/a_$q/h200_bench.json $OUT/a_$q.json 2>/dev/null
  echo "$q: $(grep -E '^a Pagoda output' $OUT/a_$q.log | head -1)"
done
left 90 few-row && timeout $((LIMIT - SECONDS - 5)) python $B/w4a16_skinny_bench.py --m 16 32 \
  --no-cuda-sweep --no-wgmma-sweep --reps 5 --out $OUT/few_row.json > $OUT/few_row.log 2>&1
[ -s $OUT/few_row.json ] && python $B/w4a16_skinny_bench.py --top 3 --family skinny \
  --out $OUT/few_row.json
echo "done in $SECONDS s"
