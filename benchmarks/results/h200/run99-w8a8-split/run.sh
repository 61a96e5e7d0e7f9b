#!/bin/bash
# The CUDA W8A8 kernel's K split among a cluster (`WgmmaW8A8Config.ck`): its GPU tests (the
# split tiles, the multicast clusters beside them, the rule) and the sampler's on the device
# (logprob_token_ids); the per-layer probe (int8, then fp8 against cuBLASLt); the W8A8 / FP8
# step table with the split in the rule and without it (PAGODA_W8A8_SPLIT_K=0) in the same
# call; on an H200 also #13's W4A16 steps and single-stream AWQ / bf16 decode.
# Parts that would not finish within LIMIT seconds are skipped.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
R=$B/results/h200/run99-w8a8-split
LIMIT=${LIMIT:-575}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt)
echo "$gpu"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w8a8_wgmma.py \
  tests/sample/test_sampler_gpu.py -k "k2 or k4 or _m2 or _m4 or _n2 or _n4 or rule or sampler \
  or cuda" -rf 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-400 | tee $OUT/tests.log
if grep -q "FAILED.*w8a8" $OUT/tests.log; then echo "split kernel failed: no timings"; exit; fi
left 160 "probe int8" && PROBE_M=128,192,256,512 timeout 150 python $R/probe.py int8 \
  > $OUT/probe_int8.log 2>&1
grep -E "^step|Error" $OUT/probe_int8.log
for s in 1 0; do
  left 75 "w8a8 table split=$s" || continue
  PAGODA_W8A8_SPLIT_K=$s timeout 70 python $B/w8a8_bench.py --m 128,192,256,512 \
    --out $OUT/w8a8_split$s.json 2>&1 | grep -v Warn > $OUT/w8a8_split$s.log
  echo "split=$s"; grep -E "^ +[0-9]+ \|" $OUT/w8a8_split$s.log | cut -c1-200
done
left 110 "probe fp8" && PROBE_M=256,512 timeout 100 python $R/probe.py fp8 \
  > $OUT/probe_fp8.log 2>&1
grep -E "^step|Error" $OUT/probe_fp8.log
if [[ $gpu == *H200* ]]; then
  left 120 "w4a16 steps" && timeout 110 python $B/w4a16_skinny_bench.py --step \
    --m 1 16 64 128 256 --reps 5 --out $OUT/w4a16_step.json > $OUT/w4a16_step.log 2>&1
  tail -7 $OUT/w4a16_step.log
  for q in awq bf16; do
    left 60 "b $q" || continue
    flag=$([ $q = bf16 ] || echo "--quantization $q")
    OUT=/tmp/b timeout 75 python $B/h200_bench.py --only b $flag > $OUT/b_$q.log 2>&1
    echo "b $q: $(grep -E '^b Pagoda decode tok/s' $OUT/b_$q.log | tr -s ' ')"
  done
fi
echo "done in $SECONDS s"
