#!/bin/bash
# The RMSNorm / SiLU-and-mul before a W8A8 / FP8 layer quantizing its output for it
# (PAGODA_W8A8_FUSED_QUANT): the GPU tests of the kernels and the engine, the step table with
# the _fq columns, then single-stream decode (b) with it on and off in turn.
# Writes $OUT/run60.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run60 && mkdir -p $O
trap 'tar czf $OUT/run60.tgz -C /tmp run60' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_fused_ops.py \
  tests/kernels/test_scaled_mm.py tests/model/test_w8a8.py -m "gpu or not slow" -rf \
  --maxfail=10 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $O/tests.log
tail -4 $O/tests.log
grep -q "FAILED" $O/tests.log && exit 1
timeout 150 python benchmarks/w8a8_bench.py --m 1,16,64,128,256,512,1024 --out $O/w8a8.json \
  2>&1 | grep -v Warn | tee $O/w8a8.log | grep -v configs
for q in fp8 w8a8; do
  for fq in 1 0; do
    PAGODA_W8A8_FUSED_QUANT=$fq OUT=/tmp/b timeout 75 python benchmarks/h200_bench.py --only b \
      --quantization $q > $O/b_${q}_fq$fq.log 2>&1
    echo "$q fused quant $fq: $(grep -E '^b Pagoda decode tok/s' $O/b_${q}_fq$fq.log)"
  done
done
echo "done in $SECONDS s"
