#!/bin/bash
# Run 94's pending check (the GEMV's GPU tests, the fused SiLU-and-mul with the scale prefetch
# among them), the GEMV ring's copy pattern alone against a plain read and the GEMV with
# bigger chunks (ring_copy.py), whole steps with and without the prefetch, then single-stream
# AWQ / bf16 decode, each where time is left.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
D=benchmarks/results/h200/run95-ring-copy
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_gemv.py \
  -rf 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-300 | tee $OUT/tests.log
timeout 200 python $D/ring_copy.py 2>&1 | grep -v Warn | tee $OUT/ring_copy.log
left 120 "steps" && timeout 110 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 16 \
  --reps 5 --gemv-variants rule sc_prefetch=0 > $OUT/step.log 2>&1
tail -6 $OUT/step.log
for q in awq bf16; do
  left 70 "b $q" || continue
  flag=$([ $q = bf16 ] || echo "--quantization $q")
  OUT=/tmp/b timeout 75 python benchmarks/h200_bench.py --only b $flag > $OUT/b_$q.log 2>&1
  echo "b $q: $(grep -E '^b Pagoda decode tok/s' $OUT/b_$q.log | tr -s ' ')"
done
echo "done in $SECONDS s"
