#!/bin/bash
# Ran on an H100 (no H200 came; README.md). The GEMV rule of run 51 (registers held to 20 resident warps an SM up to 8
# rows: 2-4% faster a step at 1-4 rows on an H100) on an H200, and the scale and zero-point
# rows prefetched into L2 by the producer at each CTA's start (`GemvConfig.sc_prefetch`: in
# run 50's stall samples the consumers waited 9% of the time for the loads they issue a step
# ahead), and x loaded at each word's turn instead of a step ahead (`x_early=0`: 8-16
# registers fewer, so that more warps fit without spilling). The GEMV's GPU tests; whole
# steps at 1-16 rows without min_warps, the rule, the rule with sc_prefetch and with
# x_early=0 and with K split among clusters of 2 CTAs (splits=2) (in one process, in turn
# twice); single-stream AWQ decode with the rule; then the ring's sweep per layer at 1, 8 and
# 16 rows (x_early 0/1 x min_warps 0/20/27/36 x 2-3 stages, and splits 2/4, `--gemv-ring`),
# from which the rule's min_warps, x_early and splits per layer can be set (qkv's 192 and
# o's 128 tiles fill one round of 264 CTA slots only in part: split, they may take half as
# long).
# Writes $OUT/run52.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run52 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py -rf --maxfail=10 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $O/tests.log
tail -4 $O/tests.log
V="min_warps=0 rule sc_prefetch=1 x_early=0 splits=2"
grep -q "FAILED" $O/tests.log && V="min_warps=0 rule"  # a faulting kernel ends the process
timeout 120 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 --gemv-variants $V \
  --reps 5 --out $O/variants.json > $O/variants.log 2>&1
tail -6 $O/variants.log
OUT=/tmp/b timeout 90 python benchmarks/h200_bench.py --only b --quantization awq > $O/b.log 2>&1
grep -E "^b Pagoda decode tok/s" $O/b.log
timeout $((560 - SECONDS)) python benchmarks/w4a16_skinny_bench.py --gemv-ring --no-sweep --no-wgmma-sweep \
  --m 1 8 16 --reps 10 --out $O/ring.json > $O/ring.log 2>&1
python benchmarks/w4a16_skinny_bench.py --top 5 --family cuda --out $O/ring.json > $O/ring_top.log 2>&1
head -40 $O/ring_top.log
tar czf $OUT/run52.tgz -C /tmp run52
echo "done in $SECONDS s"
