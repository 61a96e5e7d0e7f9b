#!/bin/bash
# Not yet run. For an H200 (#13's targets are H200 figures): whole decode steps at 1-1024
# rows with the rule, then single-stream decode (b) with dummy AWQ weights and bf16. Writes to
# $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python $B/w4a16_skinny_bench.py --step --m 1 16 64 128 192 256 1024 --reps 5 \
  > $OUT/step.log 2>&1
tail -8 $OUT/step.log
for q in awq none; do
  args=(--only b); [ $q = awq ] && args+=(--quantization awq)
  OUT=/tmp/b_$q timeout 200 python $B/h200_bench.py "${args[@]}" --time-budget 180 \
    > $OUT/b_$q.log 2>&1
  cp /tmp/b_$q/h200_bench.json $OUT/b_$q.json 2>/dev/null
  echo "$q: $(grep -E '^b ' $OUT/b_$q.log | head -2 | tr '\n' ' ')"
done
echo "done in $SECONDS s"
