#!/bin/bash
# The CUDA 8-bit kernel with K split where its tiles fill at most half the SMs (dropped after
# this run: slower everywhere), and FP8 at
# 65-128 rows on it: the GPU tests of the 8-bit path, the split against no split per layer,
# the W8A8 / FP8 step table, workload a with FP8 weights + FP8 KV cache. Writes $OUT/run69.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
O=/tmp/run69 && mkdir -p $O
trap 'tar czf $OUT/run69.tgz -C /tmp run69' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w8a8_wgmma.py \
  tests/kernels/test_scaled_mm.py tests/kernels/test_fused_ops.py tests/model/test_w8a8.py \
  2>&1 | tail -8 | tee $O/tests.log
timeout 60 python $B/results/h200/run69-w8a8-split/split_check.py 2>&1 | grep -v Warn \
  | tee $O/split_check.log
timeout 60 python $B/w8a8_bench.py --m 1,64,128,256,384,512,1024 --out $O/w8a8.json 2>&1 \
  | grep -v Warn > $O/w8a8.log
grep -E "^ +[0-9]+ \|" $O/w8a8.log | cut -c1-300
OUT=/tmp/a timeout 100 python $B/h200_bench.py --only a --quantization fp8 \
  --kv-cache-dtypes fp8 > $O/a_fp8.log 2>&1
grep -E '^a Pagoda output tok/s' $O/a_fp8.log
echo "done in $SECONDS s"
