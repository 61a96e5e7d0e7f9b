#!/bin/bash
# The rule with the wgmma kernel (gate_up from 65 rows, qkv from 129, to 256): whole decode
# steps at 128 and 256 rows, then workload a (256 requests, in/out U[100, 1024]) with dummy
# AWQ weights against bf16, as time allows (LIMIT seconds). Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-580}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
timeout 60 python $B/w4a16_skinny_bench.py --step --m 128 256 --reps 5 > $OUT/step.log 2>&1
tail -3 $OUT/step.log
for q in awq none; do
  left 100 "workload a $q" || continue
  args=(--only a); [ $q = awq ] && args+=(--quantization awq)
  half=1; [ $q = awq ] && half=2
  t=$(((LIMIT - SECONDS) / half - 10))
  OUT=/tmp/a_$q timeout $((t + 5)) python $B/h200_bench.py "${args[@]}" --time-budget $t \
    > $OUT/a_$q.log 2>&1
  echo "$q: $(grep -E '^a ' $OUT/a_$q.log | head -2)"
done
echo "done in $SECONDS s"
