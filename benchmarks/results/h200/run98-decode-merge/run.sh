#!/bin/bash
# The CUDA decode kernel's in-kernel segment merge (PAGODA_CUDA_DECODE_MERGE) and its RoPE +
# cache write (PAGODA_CUDA_DECODE_ROPE): the decode kernel's and the RoPE + cache write's GPU
# tests, single-stream AWQ decode with both on and both off, then run 97's check of the
# persistent GEMV (into $OUT/97) and the merge alone, each where time is left.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-575}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
mkdir -p $OUT/97 $OUT/98
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cuda_decode.py \
  tests/kernels/test_rotary_and_cache.py -rf 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-400 | tee $OUT/98/tests.log
b() {  # b MERGE ROPE
  left 85 "b awq merge=$1 rope=$2" || return
  local log=$OUT/98/b_awq_merge$1_rope$2.$SECONDS.log
  PAGODA_CUDA_DECODE_MERGE=$1 PAGODA_CUDA_DECODE_ROPE=$2 OUT=/tmp/b \
    timeout 80 python benchmarks/h200_bench.py --only b --quantization awq > $log 2>&1
  echo "b awq merge=$1 rope=$2: $(grep -E '^b Pagoda decode tok/s' $log | tr -s ' ')"
}
if ! grep -q failed $OUT/98/tests.log; then b 1 1; b 0 0; fi
left 300 "run 97" && OUT=$OUT/97 STEP_S=$((LIMIT - SECONDS - 220)) \
  bash benchmarks/results/h200/run97-persistent/run.sh
grep -q failed $OUT/98/tests.log || b 1 0
echo "done in $SECONDS s"
