#!/bin/bash
# The W4A16 wgmma kernel's K splits summed in a thread-block cluster (distributed shared
# memory) instead of through global memory: the kernel's GPU tests (the cluster sum against the
# global one, bit for bit), then whole decode steps at the row counts whose layers split (qkv,
# o and down at 48-64 rows, down to 256) with PAGODA_W4A16_CLUSTER_SPLIT=1, =0, =1, =0 in one
# call. On an H200 also #13's W4A16 steps at 1 and 16 rows and single-stream AWQ / bf16 decode.
# Parts that would not finish within LIMIT seconds are skipped.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-575}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt)
echo "$gpu"
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_wgmma.py \
  -k "cluster or split_k_sums or graph" -rf 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-400 | tee $OUT/tests.log
grep -q FAILED $OUT/tests.log && { echo "tests failed: no timings"; exit; }
n=0
for s in 1 0 1 0; do
  n=$((n + 1))
  left 70 "steps cluster=$s ($n)" || continue
  PAGODA_W4A16_CLUSTER_SPLIT=$s timeout 65 python $B/w4a16_skinny_bench.py --step \
    --m 48 64 128 256 --reps 10 --out $OUT/step_cluster$s.$n.json > $OUT/step_cluster$s.$n.log 2>&1
  echo "cluster=$s ($n):"; tail -6 $OUT/step_cluster$s.$n.log
done
if [[ $gpu == *H200* ]]; then
  left 80 "w4a16 steps 1 16" && timeout 75 python $B/w4a16_skinny_bench.py --step \
    --m 1 16 --reps 5 --out $OUT/w4a16_step.json > $OUT/w4a16_step.log 2>&1
  tail -4 $OUT/w4a16_step.log
  for q in awq bf16; do
    left 60 "b $q" || continue
    flag=$([ $q = bf16 ] || echo "--quantization $q")
    OUT=/tmp/b timeout 75 python $B/h200_bench.py --only b $flag > $OUT/b_$q.log 2>&1
    echo "b $q: $(grep -E '^b Pagoda decode tok/s' $OUT/b_$q.log | tr -s ' ')"
  done
  left 80 "w8a8 table" && timeout 75 python $B/w8a8_bench.py --m 1,64,128,192,256,512,1024 \
    --out $OUT/w8a8.json 2>&1 | grep -v Warn > $OUT/w8a8.log
  grep -E "^ +[0-9]+ \|" $OUT/w8a8.log | cut -c1-200
fi
echo "done in $SECONDS s"
