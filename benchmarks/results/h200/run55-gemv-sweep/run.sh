#!/bin/bash
# The GEMV of run 54 (a step's group a compile-time shift, scales and zero points at fixed
# offsets, one step an iteration) with its rule (min_warps off): single-stream AWQ decode,
# then the ring's sweep per layer at 1, 4, 8 and 16 rows (x_early x min_warps 0/20/27/36 x
# 2-3 stages, and splits 2/4; `--gemv-ring`) and its best five a layer (`--top`).
# Writes $OUT/run55.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run55 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
OUT=/tmp/b timeout 100 python benchmarks/h200_bench.py --only b --quantization awq > $O/b.log 2>&1
grep -E "^b Pagoda decode tok/s" $O/b.log
timeout $((500 - SECONDS)) python benchmarks/w4a16_skinny_bench.py --gemv-ring --no-sweep \
  --no-wgmma-sweep --m 1 4 8 16 --reps 10 --out $O/ring.json > $O/ring.log 2>&1
python benchmarks/w4a16_skinny_bench.py --top 5 --family cuda --out $O/ring.json > $O/ring_top.log 2>&1
cat $O/ring_top.log
tail -8 $O/ring.log
tar czf $OUT/run55.tgz -C /tmp run55
echo "done in $SECONDS s"
