#!/bin/bash
# #13's figures on the H200 they are set for (the last H200 runs were 50 and
# 32-45; every run since came on an H100), with the code as it is: the int8 tile rule against
# the rule before it (run 65's rule_check.py), the W8A8 / FP8 step table (FP8 fast
# accumulation, fp8_fq_exact beside it), whole W4A16 decode steps, single-stream AWQ and bf16
# decode, and workload a with FP8 weights + FP8 KV cache. Ask for `nvidia-h200`. Parts that
# would not finish within LIMIT seconds are skipped. Writes $OUT/run66.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
O=/tmp/run66 && mkdir -p $O
trap 'tar czf $OUT/run66.tgz -C /tmp run66' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 100 python $B/results/h200/run65-w8a8-one-wave/rule_check.py 2>&1 | grep -v Warn \
  | tee $O/rule_check.log
left 150 "w8a8 table" && timeout 140 python $B/w8a8_bench.py --m 1,64,256,512,1024 \
  --out $O/w8a8.json 2>&1 | grep -v Warn > $O/w8a8.log
grep -E "^ +[0-9]+ \|" $O/w8a8.log | cut -c1-300
left 120 "w4a16 steps" && timeout 110 python $B/w4a16_skinny_bench.py --step \
  --m 1 16 64 128 256 --reps 5 --out $O/w4a16_step.json > $O/w4a16_step.log 2>&1
tail -7 $O/w4a16_step.log
for q in awq bf16; do
  left 60 "b $q" || continue
  flag=$([ $q = bf16 ] || echo "--quantization $q")
  OUT=/tmp/b timeout 75 python $B/h200_bench.py --only b $flag > $O/b_$q.log 2>&1
  echo "b $q: $(grep -E '^b Pagoda decode tok/s' $O/b_$q.log | tr -s ' ')"
done
left 60 "a fp8" && OUT=/tmp/a timeout 90 python $B/h200_bench.py --only a --quantization fp8 \
  --kv-cache-dtypes fp8 > $O/a_fp8.log 2>&1
grep -E '^a Pagoda output tok/s' $O/a_fp8.log
echo "done in $SECONDS s"
