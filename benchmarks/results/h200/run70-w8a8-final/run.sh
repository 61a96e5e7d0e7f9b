#!/bin/bash
# The 8-bit rule as committed (CUDA kernel for int8 from 65 rows, fp8 at 65-128, 64 x 64 tiles
# for o at 129-256 rows): its GPU tests and the step table. Writes $OUT/run70.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run70 && mkdir -p $O
trap 'tar czf $OUT/run70.tgz -C /tmp run70' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 60 python -m pytest -q -m gpu tests/kernels/test_w8a8_wgmma.py 2>&1 | tail -3 \
  | tee $O/tests.log
timeout 60 python benchmarks/w8a8_bench.py --m 1,64,128,192,256,384,512,1024 \
  --out $O/w8a8.json 2>&1 | grep -v Warn > $O/w8a8.log
grep -E "^ +[0-9]+ \|" $O/w8a8.log | cut -c1-300
echo "done in $SECONDS s"
