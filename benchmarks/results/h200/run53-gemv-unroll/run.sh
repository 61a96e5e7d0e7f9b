#!/bin/bash
# The ring GEMV with fewer instructions a K step: a step's group by a compile-time shift
# (GROUP_STEPS) instead of a division, its scales and zero points at fixed offsets from one
# address (the last CTA's rows end at N instead of being clamped), and two steps a loop
# iteration with the registers of the step ahead swapped instead of copied (sm_90 builds:
# 10-20% fewer SASS instructions a step). GPU tests of the GEMV; whole steps at 1-16 rows
# with the rule and without its min_warps, for this code and for the code before it (old/,
# the files of the commit before, copied over a copy of the tree), in turn; single-stream
# AWQ decode with the new code.
# Writes $OUT/run53.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
HERE=benchmarks/results/h200/run53-gemv-unroll
O=/tmp/run53 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
rm -rf /tmp/oldtree && cp -r . /tmp/oldtree
cp $HERE/old/w4a16_gemv.cu $HERE/old/w4a16_gemv.py $HERE/old/w4a16.py /tmp/oldtree/pagoda/kernels/
cp $HERE/old/w4a16_skinny_bench.py /tmp/oldtree/benchmarks/
timeout 170 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py -rf --maxfail=10 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $O/tests.log
tail -4 $O/tests.log
V="rule min_warps=0"
for pass in 1 2; do
  timeout 100 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 --gemv-variants $V \
    --reps 5 --out $O/new$pass.json > $O/new$pass.log 2>&1
  echo "new $pass"; tail -5 $O/new$pass.log
  (cd /tmp/oldtree && timeout 100 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 \
    --gemv-variants $V --reps 5 --out $O/old$pass.json > $O/old$pass.log 2>&1)
  echo "old $pass"; tail -5 $O/old$pass.log
done
OUT=/tmp/b timeout 90 python benchmarks/h200_bench.py --only b --quantization awq > $O/b.log 2>&1
grep -E "^b Pagoda decode tok/s" $O/b.log
tar czf $OUT/run53.tgz -C /tmp run53
echo "done in $SECONDS s"
