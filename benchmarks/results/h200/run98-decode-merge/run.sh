#!/bin/bash
# The CUDA decode kernel's in-kernel segment merge (PAGODA_CUDA_DECODE_MERGE) and its RoPE +
# cache write (PAGODA_CUDA_DECODE_ROPE). PART=tests (default): run 97's check of the
# persistent GEMV (into $OUT/97), then the decode kernel's and the RoPE + cache write's GPU
# tests. PART=bench: single-stream AWQ decode with both on, both off, the merge alone.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-570}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
mkdir -p $OUT/97 $OUT/98
if [ "${PART:-tests}" = tests ]; then
  OUT=$OUT/97 STEP_S=${STEP_S:-170} bash benchmarks/results/h200/run97-persistent/run.sh
  timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cuda_decode.py \
    tests/kernels/test_rotary_and_cache.py -rf 2>&1 | grep -E "FAILED|passed|failed|rror" \
    | cut -c1-400 | tee $OUT/98/tests.log
else
  for mr in 11 00 10 11; do
    left 80 "b awq $mr" || continue
    log=$OUT/98/b_awq_merge${mr:0:1}_rope${mr:1:1}.$SECONDS.log
    PAGODA_CUDA_DECODE_MERGE=${mr:0:1} PAGODA_CUDA_DECODE_ROPE=${mr:1:1} OUT=/tmp/b \
      timeout 80 python benchmarks/h200_bench.py --only b --quantization awq > $log 2>&1
    echo "b awq merge=${mr:0:1} rope=${mr:1:1}: $(grep -E '^b Pagoda decode tok/s' $log | tr -s ' ')"
  done
fi
echo "done in $SECONDS s"
