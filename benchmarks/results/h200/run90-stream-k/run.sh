#!/bin/bash
# The wgmma W4A16 kernel on a Stream-K grid (`WgmmaConfig.stream_k`: as many CTAs as fit the
# GPU at once, sharing the tiles' K steps evenly, partial tiles summed by the last to arrive),
# for the idle SMs of short grids and the part-empty second rounds that Nsight Compute showed
# (run 89): its GPU tests; the sweep at 32-256 rows of the rule's configs against Stream-K ones
# (`--wgmma-stream-k`: families wgmma_best and streamk_best per layer); whole decode steps with
# each family's fastest configs per layer (`--step --best-from`) beside the rule and bf16
# cuBLAS. Steps that would not finish within LIMIT seconds (560 by default) are skipped.
# Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_wgmma.py \
  tests/kernels/test_w8a8_wgmma.py -rf 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-300 > $OUT/tests.log
tail -6 $OUT/tests.log
left 120 sweep && timeout 240 python $B/w4a16_skinny_bench.py --m 32 64 128 256 --no-sweep \
  --no-cuda-sweep --wgmma-stream-k --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1
grep -E "^(qkv|o|gate_up|down) |^ *[0-9]+ " $OUT/sweep.log | cut -c1-400
for f in wgmma streamk; do
  [ -s $OUT/sweep.json ] && python $B/w4a16_skinny_bench.py --top 3 --family $f \
    --out $OUT/sweep.json > $OUT/top_$f.log 2>&1
done
left 40 step && timeout $((LIMIT - SECONDS - 5)) python $B/w4a16_skinny_bench.py --step \
  --m 32 64 128 256 --reps 5 --best-from $OUT/sweep.json > $OUT/step.log 2>&1
tail -14 $OUT/step.log
echo "done in $SECONDS s"
