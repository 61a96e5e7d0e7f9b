#!/bin/bash
# The rule taken to 1024 rows (256-row tiles from 513): the W4A16 rule tests, whole decode
# steps at 512-1024 rows, then workload a again (its spread from run5). Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-240}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python -m pytest -q tests/kernels/test_w4a16_wgmma.py tests/kernels/test_w4a16.py \
  -m "gpu or not gpu" -k "rule or choose_config or llama8b" -rf > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log | cut -c1-300
timeout 60 python $B/w4a16_skinny_bench.py --step --m 512 768 1024 --reps 5 > $OUT/step.log 2>&1
tail -4 $OUT/step.log
for q in awq none; do
  [ $((LIMIT - SECONDS)) -gt 60 ] || { echo "skipped (time): workload a $q"; continue; }
  args=(--only a); [ $q = awq ] && args+=(--quantization awq)
  half=1; [ $q = awq ] && half=2
  t=$(((LIMIT - SECONDS) / half - 10))
  OUT=/tmp/a_$q timeout $((t + 5)) python $B/h200_bench.py "${args[@]}" --time-budget $t \
    > $OUT/a_$q.log 2>&1
  cp /tmp/a_$q/h200_bench.json $OUT/a_$q.json 2>/dev/null
  echo "$q: $(grep -E '^a Pagoda output' $OUT/a_$q.log | head -1)"
done
echo "done in $SECONDS s"
