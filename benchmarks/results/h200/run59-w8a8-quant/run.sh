#!/bin/bash
# The W8A8 / FP8 step table with the activation quantization alone as a column of its own
# (`w8a8_bench.py`'s quant column): how much of an 8-bit step is the per-token quantization.
# Writes $OUT/run59.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run59 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 400 python benchmarks/w8a8_bench.py --m 1,16,64,128,256,512,1024 --out $O/w8a8.json \
  2>&1 | grep -v Warn | tee $O/w8a8.log
tar czf $OUT/run59.tgz -C /tmp run59
echo "done in $SECONDS s"
