#!/bin/bash
# The rule taken to 512 rows (gate_up and down): whole decode steps at 128-512 rows, then
# workload a with dummy AWQ weights against bf16 (LIMIT seconds). Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-400}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 70 python $B/w4a16_skinny_bench.py --step --m 128 256 384 512 --reps 5 > $OUT/step.log 2>&1
tail -5 $OUT/step.log
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
