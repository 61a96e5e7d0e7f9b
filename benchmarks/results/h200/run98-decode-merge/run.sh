#!/bin/bash
# Run 97's check of the persistent GEMV (into $OUT/97), then the decode attention's in-kernel
# segment merge (PAGODA_CUDA_DECODE_MERGE): the CUDA decode kernel's GPU tests, and single-stream
# AWQ decode with the merge in the kernel and with the separate merge kernel, each where time
# is left.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-570}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
mkdir -p $OUT/97 $OUT/98
OUT=$OUT/97 STEP_S=${STEP_S:-170} bash benchmarks/results/h200/run97-persistent/run.sh
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cuda_decode.py \
  -rf 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-300 | tee $OUT/98/tests.log
grep -q failed $OUT/98/tests.log && exit 1
for merge in 1 0 1; do
  left 70 "b awq merge=$merge" || continue
  log=$OUT/98/b_awq_merge$merge.$SECONDS.log
  PAGODA_CUDA_DECODE_MERGE=$merge OUT=/tmp/b timeout 75 python benchmarks/h200_bench.py \
    --only b --quantization awq > $log 2>&1
  echo "b awq merge=$merge: $(grep -E '^b Pagoda decode tok/s' $log | tr -s ' ')"
done
echo "done in $SECONDS s"
