#!/bin/bash
# Not yet run. The GEMV rule of run 51 (registers held to 20 resident warps an SM up to 8
# rows: 2-4% faster a step at 1-4 rows on an H100) on an H200, and the scale and zero-point
# rows prefetched into L2 by the producer at each CTA's start (`GemvConfig.sc_prefetch`: in
# run 50's stall samples the consumers waited 9% of the time for the loads they issue a step
# ahead). The GEMV's GPU tests; whole steps at 1-16 rows without min_warps, the rule, and
# the rule with sc_prefetch (in one process, in turn twice); single-stream AWQ decode with
# the rule. Writes $OUT/run52.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run52 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py -rf --maxfail=10 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $O/tests.log
tail -4 $O/tests.log
V="min_warps=0 rule sc_prefetch=1"
grep -q "FAILED.*sc_prefetch" $O/tests.log && V="min_warps=0 rule"
timeout 120 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 --gemv-variants $V \
  --reps 5 --out $O/variants.json > $O/variants.log 2>&1
tail -6 $O/variants.log
OUT=/tmp/b timeout 90 python benchmarks/h200_bench.py --only b --quantization awq > $O/b.log 2>&1
grep -E "^b Pagoda decode tok/s" $O/b.log
tar czf $OUT/run52.tgz -C /tmp run52
echo "done in $SECONDS s"
