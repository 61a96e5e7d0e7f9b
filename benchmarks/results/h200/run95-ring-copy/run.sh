#!/bin/bash
# The GEMV ring's copy pattern alone against a plain read and the GEMV (ring_copy.py), then
# run 94's pending check (the fused SiLU-and-mul GEMV with the scale prefetch: GPU tests, steps),
# then single-stream AWQ / bf16 decode where time is left.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-560}
D=benchmarks/results/h200/run95-ring-copy
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python $D/ring_copy.py 2>&1 | grep -v Warn | tee $OUT/ring_copy.log
bash benchmarks/results/h200/run94-sc-prefetch/check.sh
for q in awq bf16; do
  [ $((LIMIT - SECONDS)) -gt 70 ] || { echo "skipped (time): b $q"; continue; }
  flag=$([ $q = bf16 ] || echo "--quantization $q")
  OUT=/tmp/b timeout 75 python benchmarks/h200_bench.py --only b $flag > $OUT/b_$q.log 2>&1
  echo "b $q: $(grep -E '^b Pagoda decode tok/s' $OUT/b_$q.log | tr -s ' ')"
done
echo "done in $SECONDS s"
