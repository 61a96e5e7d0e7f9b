#!/bin/bash
# The W8A8 rule with its K split (run 99's probe made it): the GPU tests of the 8-bit path
# (the kernel's rule, fp8 past 128 rows taking it for o and down, the model's 8-bit layers);
# the W8A8 / FP8 step table with the split and without it (PAGODA_W8A8_SPLIT_K=0) in the same
# call; end to end workload a with INT8 weights (FP8 KV cache) both ways. On an H200, before
# the runs without the split, #13's W4A16 steps, single-stream AWQ / bf16 decode and workload
# a with FP8 weights.
# Parts that would not finish within LIMIT seconds are skipped.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-575}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt)
echo "$gpu"
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_scaled_mm.py \
  tests/model/test_w8a8.py tests/kernels/test_w8a8_wgmma.py -k "not test_every_tile" -rf 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-400 | tee $OUT/tests.log
grep -q FAILED $OUT/tests.log && { echo "tests failed: no timings"; exit; }
table() {  # table SPLIT
  left 80 "w8a8 table split=$1" || return
  PAGODA_W8A8_SPLIT_K=$1 timeout 75 python $B/w8a8_bench.py --m 128,160,192,256,384,512,1024 \
    --out $OUT/w8a8_split$1.json 2>&1 | grep -v Warn > $OUT/w8a8_split$1.log
  echo "split=$1"; grep -E "^ +[0-9]+ \|" $OUT/w8a8_split$1.log | cut -c1-200
}
a() {  # a QUANTIZATION SPLIT
  left 95 "a $1 split=$2" || return
  PAGODA_W8A8_SPLIT_K=$2 OUT=/tmp/a timeout 90 python $B/h200_bench.py --only a \
    --quantization $1 --kv-cache-dtypes fp8 > $OUT/a_$1_split$2.log 2>&1
  echo "a $1 split=$2: $(grep -E '^a Pagoda output tok/s' $OUT/a_$1_split$2.log | tr -s ' ')"
}
table 1
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
  a fp8 1
fi
table 0
a w8a8 1
a w8a8 0
echo "done in $SECONDS s"
