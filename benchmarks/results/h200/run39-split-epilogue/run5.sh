#!/bin/bash
# The bulk-copy wgmma kernel and its rule: the W4A16 GPU tests, the sweep at 1024 rows, whole
# decode steps at 32-1024 rows, then workload a (256 requests, in/out U[100, 1024]) with dummy
# AWQ weights against bf16 as time allows (LIMIT seconds). Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-540}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py \
  tests/kernels/test_w4a16.py tests/kernels/test_w4a16_gemv.py -rf > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log | cut -c1-300
timeout 100 python $B/w4a16_skinny_bench.py --m 1024 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; grep -E "^(qkv|o |gate|down)" $OUT/sweep.log | cut -c1-200
timeout 90 python $B/w4a16_skinny_bench.py --step --m 32 64 128 192 256 512 1024 --reps 5 \
  > $OUT/step.log 2>&1
tail -8 $OUT/step.log
for q in awq none; do
  [ $((LIMIT - SECONDS)) -gt 100 ] || { echo "skipped (time): workload a $q"; continue; }
  args=(--only a); [ $q = awq ] && args+=(--quantization awq)
  half=1; [ $q = awq ] && half=2
  t=$(((LIMIT - SECONDS) / half - 10))
  OUT=/tmp/a_$q timeout $((t + 5)) python $B/h200_bench.py "${args[@]}" --time-budget $t \
    > $OUT/a_$q.log 2>&1
  cp /tmp/a_$q/h200_bench.json $OUT/a_$q.json 2>/dev/null
  echo "$q: $(grep -E '^a Pagoda output' $OUT/a_$q.log | head -1)"
done
echo "done in $SECONDS s"
