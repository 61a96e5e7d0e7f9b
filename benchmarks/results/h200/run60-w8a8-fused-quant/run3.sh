#!/bin/bash
# After the one-pass SiLU-and-mul quantization: its GPU tests, the FP8 decode step's kernels
# (fused quant on and off), single-stream decode (b) and workload a (256 requests, FP8 KV
# cache) with PAGODA_W8A8_FUSED_QUANT 1 and 0. Writes $OUT/run60c.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run60c && mkdir -p $O
trap 'tar czf $OUT/run60c.tgz -C /tmp run60c' EXIT
timeout 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_fused_ops.py 2>&1 | tail -1
for fq in 1 0; do
  PAGODA_W8A8_FUSED_QUANT=$fq timeout 60 python benchmarks/decode_step_profile.py \
    --quantization fp8 --out $O/profile_fq$fq.json > $O/profile_fq$fq.log 2>&1
  grep -v "INFO\|arn" $O/profile_fq$fq.log | head -10
done
for fq in 1 0; do
  PAGODA_W8A8_FUSED_QUANT=$fq OUT=/tmp/b timeout 75 python benchmarks/h200_bench.py --only b \
    --quantization fp8 > $O/b_fp8_fq$fq.log 2>&1
  echo "fp8 fused quant $fq: $(grep -E '^b Pagoda decode tok/s' $O/b_fp8_fq$fq.log)"
done
for fq in 1 0; do
  PAGODA_W8A8_FUSED_QUANT=$fq OUT=/tmp/a timeout 130 python benchmarks/h200_bench.py --only a \
    --quantization fp8 --kv-cache-dtypes fp8 > $O/a_fp8_fq$fq.log 2>&1
  echo "fp8 fused quant $fq: $(grep -E '^a Pagoda output tok/s' $O/a_fp8_fq$fq.log)"
done
echo "done in $SECONDS s"
