#!/bin/bash
# FP8 GEMMs accumulating in the tensor cores' own precision across K (PAGODA_FP8_FAST_ACCUM=1,
# cuBLASLt's use_fast_accum and the Triton GEMM without per-K-tile promotion) against each K
# tile promoted to float32 (=0), same call: the GPU tests, the step table (fp8_fq vs
# fp8_fq_exact, and each column's error), workload a and single stream with FP8 weights and
# an FP8 KV cache. Parts that would not finish within LIMIT seconds are skipped.
# Writes $OUT/run64.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-500}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
O=/tmp/run64 && mkdir -p $O
trap 'tar czf $OUT/run64.tgz -C /tmp run64' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_scaled_mm.py \
  -m gpu -k "accum or matches_dequantize or without_bias" -rf 2>&1 \
  | grep -E "FAILED|passed|failed" | cut -c1-300 > $O/tests.log
tail -3 $O/tests.log
left 200 "step table" && timeout 150 python benchmarks/w8a8_bench.py \
  --m 1,16,64,128,256,512,1024 --out $O/w8a8.json 2>&1 | grep -v Warn > $O/w8a8.log
grep -E "error|^ +[0-9]+ \|" $O/w8a8.log | cut -c1-400
for fast in 1 0 1 0; do
  left 75 "a,b fast=$fast" || continue
  PAGODA_FP8_FAST_ACCUM=$fast OUT=/tmp/a timeout 90 python benchmarks/h200_bench.py --only a,b \
    --quantization fp8 --kv-cache-dtypes fp8 > $O/ab_fast$fast.$SECONDS.log 2>&1
  echo "fast=$fast: $(grep -hE '^(a Pagoda output|b Pagoda decode) tok/s' $O/ab_fast$fast.*.log \
    | tail -2 | tr -s ' ')"
done
echo "done in $SECONDS s"
