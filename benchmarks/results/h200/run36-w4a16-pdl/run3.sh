#!/bin/bash
# The last call this session's device time allowed: the W4A16 GEMV tests, whole decode steps
# with the bulk + PDL rule (against PDL off and the register rule), and single-stream decode
# end to end with PDL on and off. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
timeout 70 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py -rf 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $OUT/tests.log; tail -2 $OUT/tests.log
timeout 70 python $B/w4a16_skinny_bench.py --step --m 1 4 8 16 --reps 5 \
  --out $OUT/step.json > $OUT/step.log 2>&1; tail -6 $OUT/step.log
for p in 1 0; do
  mkdir -p $OUT/b_pdl$p
  PAGODA_PDL=$p OUT=$OUT/b_pdl$p timeout 80 python $B/h200_bench.py --only b --quantization awq \
    > $OUT/b_pdl$p/log 2>&1
  rm -f $OUT/b_pdl$p/h200_bench.json
  echo "PDL=$p: $(grep -E '^b Pagoda decode tok/s' $OUT/b_pdl$p/log)"
done
