#!/bin/bash
# The GEMV's L2 prefetch of the next 4-bit layer's weights (PAGODA_L2_PREFETCH_MB): GPU tests
# of the GEMV and of packed checkpoints, then single-stream AWQ decode end to end with the
# prefetch off (0) and on (16, 64 MB), alternated. Steps that would not finish within LIMIT
# seconds (560 by default) are skipped. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py \
  tests/model/test_quantized_checkpoints.py -rf 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-300 > $OUT/tests.log; tail -4 $OUT/tests.log
i=0
for mb in 0 16 64 0 16; do
  i=$((i + 1))
  left 80 "e2e MB=$mb" || continue
  PAGODA_L2_PREFETCH_MB=$mb OUT=/tmp/b$mb timeout 75 python $B/h200_bench.py --only b \
    --quantization awq > $OUT/b${i}_mb$mb.log 2>&1
  echo "MB=$mb: $(grep -E '^b Pagoda decode tok/s' $OUT/b${i}_mb$mb.log)"
done
echo "done in $SECONDS s"
