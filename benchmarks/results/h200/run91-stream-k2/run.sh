#!/bin/bash
# Run 90's Stream-K grid with its shared tiles done early (a CTA runs the head of its last tile
# first) and their fp32 partials stored with an L2 evict-last policy (run 90: 67% more DRAM
# traffic than the grid of tiles, the partials evicted by the streamed weights and summed by
# every CTA at once at the end): its GPU tests; the sweep at 64-256 rows (`--wgmma-stream-k`);
# whole steps with each family's fastest configs per layer; Nsight Compute on gate_up at 256
# rows, Stream-K against the grid of tiles. Steps that would not finish within LIMIT seconds
# (560 by default) are skipped. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_wgmma.py \
  -rf 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $OUT/tests.log
tail -4 $OUT/tests.log
left 120 sweep && timeout 200 python $B/w4a16_skinny_bench.py --m 64 128 256 --no-sweep \
  --no-cuda-sweep --wgmma-stream-k --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1
grep -E "^(qkv|o|gate_up|down) |^ *[0-9]+ " $OUT/sweep.log | cut -c1-400
for f in wgmma streamk; do
  [ -s $OUT/sweep.json ] && python $B/w4a16_skinny_bench.py --top 3 --family $f \
    --out $OUT/sweep.json > $OUT/top_$f.log 2>&1
done
left 60 step && timeout 90 python $B/w4a16_skinny_bench.py --step \
  --m 64 128 256 --reps 5 --best-from $OUT/sweep.json > $OUT/step.log 2>&1
tail -10 $OUT/step.log
R=benchmarks/results/h200/run89-ncu
for cfg in "WgmmaConfig(bn=256,stages=3,a_buffers=1,stream_k=1)" "WgmmaConfig(bn=256,stages=3,a_buffers=1)"; do
  left 40 "ncu $cfg" || continue
  f=$OUT/ncu_gate_up_256_$(echo $cfg | tr -dc 'a-z0-9_').txt
  timeout 60 ncu --profile-from-start off -k regex:pagoda -c 1 --section SpeedOfLight \
    --section InstructionStats --section MemoryWorkloadAnalysis \
    python $R/one_gemm.py gate_up 256 1 "$cfg" > $f 2>&1
  echo "== $cfg"; grep -E "Duration|DRAM Throughput|Executed Instructions  |SM Active" $f
done
echo "done in $SECONDS s"
