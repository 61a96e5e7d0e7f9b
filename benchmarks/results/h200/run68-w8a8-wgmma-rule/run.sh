#!/bin/bash
# The int8 rule with the CUDA wgmma kernel from 65 rows: the W8A8 / FP8 step table with it and
# without it (PAGODA_W8A8_CUDA=0) in the same call, the GPU tests of the 8-bit path, the
# kernel on fp8 operands against cuBLASLt per layer (run 67's probe.py), and workload a with
# INT8 weights + FP8 KV cache with and without it. Writes $OUT/run68.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
O=/tmp/run68 && mkdir -p $O
trap 'tar czf $OUT/run68.tgz -C /tmp run68' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
for c in 1 0; do
  PAGODA_W8A8_CUDA=$c timeout 100 python $B/w8a8_bench.py --m 1,64,128,256,384,512,1024 \
    --out $O/w8a8_cuda$c.json 2>&1 | grep -v Warn > $O/w8a8_cuda$c.log
  echo "PAGODA_W8A8_CUDA=$c"; grep -E "^ +[0-9]+ \|" $O/w8a8_cuda$c.log | cut -c1-300
done
timeout 240 python -m pytest -q -m gpu tests/kernels/test_w8a8_wgmma.py \
  tests/kernels/test_scaled_mm.py tests/kernels/test_fused_ops.py tests/model/test_w8a8.py \
  2>&1 | tail -8 | tee $O/tests.log
timeout 150 python benchmarks/results/h200/run67-w8a8-wgmma/probe.py fp8 2>&1 | grep -v Warn \
  > $O/fp8_probe.log
grep -E "checks took|rel err [1-9]e-0[12]|step M" $O/fp8_probe.log
for c in 1 0; do
  PAGODA_W8A8_CUDA=$c OUT=/tmp/a timeout 100 python $B/h200_bench.py --only a \
    --quantization w8a8 --kv-cache-dtypes fp8 > $O/a_w8a8_cuda$c.log 2>&1
  echo "a w8a8 PAGODA_W8A8_CUDA=$c: $(grep -E '^a Pagoda output tok/s' $O/a_w8a8_cuda$c.log)"
done
echo "done in $SECONDS s"
