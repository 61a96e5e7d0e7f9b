#!/bin/bash
# The GEMV's new rule (run 55's sweep: min_warps off; past 8 rows a layer of more 32-row
# tiles than SMs takes 4 warps and 3 stages) against the code before run 53 (run53's old/
# copied over a copy of the tree), on the same GPU in one call: the W4A16 GPU tests, whole
# steps (`--step`) at 1-64 rows with each, then single-stream AWQ decode with each.
# Writes $OUT/run56.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
OLD=benchmarks/results/h200/run53-gemv-unroll/old
O=/tmp/run56 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
rm -rf /tmp/oldtree && cp -r . /tmp/oldtree
cp $OLD/w4a16_gemv.cu $OLD/w4a16_gemv.py $OLD/w4a16.py /tmp/oldtree/pagoda/kernels/
cp $OLD/w4a16_skinny_bench.py /tmp/oldtree/benchmarks/
timeout 240 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py tests/kernels/test_w4a16.py \
  -rf --maxfail=10 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $O/tests.log
tail -4 $O/tests.log
for pass in 1 2; do
  timeout 100 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 --reps 10 \
    --out $O/new$pass.json > $O/new$pass.log 2>&1
  echo "new $pass"; grep -A6 "^ *M " $O/new$pass.log | head -6
  (cd /tmp/oldtree && timeout 100 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 \
    --reps 10 --out $O/old$pass.json > $O/old$pass.log 2>&1)
  echo "old $pass"; grep -A6 "^ *M " $O/old$pass.log | head -6
done
OUT=/tmp/b timeout 100 python benchmarks/h200_bench.py --only b --quantization awq > $O/b_new.log 2>&1
grep -E "^b Pagoda decode tok/s" $O/b_new.log
(cd /tmp/oldtree && OUT=/tmp/b2 timeout 100 python benchmarks/h200_bench.py --only b \
  --quantization awq > $O/b_old.log 2>&1)
grep -E "^b Pagoda decode tok/s" $O/b_old.log
tar czf $OUT/run56.tgz -C /tmp run56
echo "done in $SECONDS s"
