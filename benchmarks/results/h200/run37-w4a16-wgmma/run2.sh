#!/bin/bash
# PDL for every kernel between the GEMMs (RMSNorm, SiLU-and-mul, RoPE + cache, decode attention,
# segment reduce now wait as programmatic dependents): the GPU tests of those kernels and of the
# GEMV (its PDL chain test, the bulk ring past 16 rows), then single-stream AWQ decode end to
# end with PDL on and off. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 260 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py tests/kernels/test_gpu_kernels.py tests/kernels/test_fused_ops.py \
  tests/kernels/test_cuda_decode.py tests/attention tests/engine/test_gpu_engine.py -rf 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $OUT/tests.log; tail -4 $OUT/tests.log
for p in 1 0; do
  mkdir -p $OUT/b_pdl$p
  PAGODA_PDL=$p OUT=$OUT/b_pdl$p timeout 100 python $B/h200_bench.py --only b --quantization awq \
    > $OUT/b_pdl$p/log 2>&1
  rm -f $OUT/b_pdl$p/h200_bench.json
  echo "PDL=$p: $(grep -E '^b Pagoda decode tok/s' $OUT/b_pdl$p/log)"
done
