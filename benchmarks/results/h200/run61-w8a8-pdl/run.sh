#!/bin/bash
# The W8A8 / FP8 Triton GEMM and its row quantization launched as programmatic dependents
# (PDL), against the code before (cea97d5, `old/scaled_mm_triton.py`, not kept in git:
# `git show cea97d5:pagoda/kernels/scaled_mm_triton.py`) in the same call: GPU tests, then
# single-stream decode (b) FP8 and W8A8, new and old in turn, and the step table.
# Writes $OUT/run61.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run61 && mkdir -p $O
trap 'tar czf $OUT/run61.tgz -C /tmp run61' EXIT
R=$PWD && rm -rf /tmp/old && cp -r . /tmp/old
cp benchmarks/results/h200/run61-w8a8-pdl/old/scaled_mm_triton.py /tmp/old/pagoda/kernels/
timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_scaled_mm.py \
  tests/model/test_w8a8.py -m "gpu or not slow" -rf 2>&1 | grep -E "FAILED|passed|failed" \
  | cut -c1-300 > $O/tests.log
tail -3 $O/tests.log
grep -q "FAILED" $O/tests.log && exit 1
for q in fp8 w8a8; do
  for v in new old new old; do
    d=$R; [ $v = old ] && d=/tmp/old
    (cd $d && OUT=/tmp/b timeout 70 python benchmarks/h200_bench.py --only b --quantization $q \
      > $O/b_${q}_$v.log 2>&1)
    echo "$q $v: $(grep -E '^b Pagoda decode tok/s' $O/b_${q}_$v.log)"
  done
done
echo "done in $SECONDS s"
