#!/bin/bash
# The GEMV of run 53 with its two steps an iteration made a choice (GemvConfig.two_steps,
# off by default): whole steps at 1-16 rows with the rule, two_steps=1, min_warps=0 and both,
# then the code before run 53 (run53-gemv-unroll/old/ copied over a copy of the tree) with
# its rule and min_warps=0; the GEMV's GPU tests first.
# Writes $OUT/run54.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
OLD=benchmarks/results/h200/run53-gemv-unroll/old
O=/tmp/run54 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
rm -rf /tmp/oldtree && cp -r . /tmp/oldtree
cp $OLD/w4a16_gemv.cu $OLD/w4a16_gemv.py $OLD/w4a16.py /tmp/oldtree/pagoda/kernels/
cp $OLD/w4a16_skinny_bench.py /tmp/oldtree/benchmarks/
timeout 200 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py -rf --maxfail=10 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $O/tests.log
tail -4 $O/tests.log
timeout 150 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 --reps 5 \
  --gemv-variants rule two_steps=1 min_warps=0 two_steps=1,min_warps=0 \
  --out $O/new.json > $O/new.log 2>&1
tail -6 $O/new.log
(cd /tmp/oldtree && timeout 100 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 \
  --gemv-variants rule min_warps=0 --reps 5 --out $O/old.json > $O/old.log 2>&1)
tail -6 $O/old.log
tar czf $OUT/run54.tgz -C /tmp run54
echo "done in $SECONDS s"
