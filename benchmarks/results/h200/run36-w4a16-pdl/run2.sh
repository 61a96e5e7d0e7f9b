#!/bin/bash
# The second call: the bulk ring's fix past 16 rows and the new rule (bulk + PDL up to 16
# rows). GPU tests, whole decode steps, end to end: single stream with PDL on and off, and
# workload a with AWQ. Writes to $OUT (one folder per end-to-end run).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
timeout 100 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py tests/kernels/test_w4a16.py \
  tests/kernels/test_fused_ops.py tests/kernels/test_cuda_decode.py -rf 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $OUT/tests.log; tail -3 $OUT/tests.log
timeout 80 python $B/w4a16_skinny_bench.py --step --m 1 4 8 16 --reps 5 \
  --out $OUT/step.json > $OUT/step.log 2>&1; tail -6 $OUT/step.log
for run in "b_pdl1 1 b awq" "b_pdl0 0 b awq" "a_awq 1 a awq"; do
  set -- $run; mkdir -p $OUT/$1
  q=""; [ "$4" != "-" ] && q="--quantization $4"
  PAGODA_PDL=$2 OUT=$OUT/$1 timeout 110 python $B/h200_bench.py --only $3 $q > $OUT/$1/log 2>&1
  rm -f $OUT/$1/h200_bench.json
  echo "$1: $(grep -E '^(a Pagoda output|b Pagoda decode) tok/s' $OUT/$1/log)"
done
