#!/bin/bash
# Where a single-stream decode step's GPU time goes (Llama-3-8B shape, dummy weights, CUDA
# graphs): the kernels of 20 steps under torch.profiler, AWQ and bf16
# (`benchmarks/decode_step_profile.py`).
# Writes $OUT/run57.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run57 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 200 python benchmarks/decode_step_profile.py --quantization awq --out $O/awq.json \
  > $O/awq.log 2>&1
head -45 $O/awq.log | grep -v Warning
timeout 200 python benchmarks/decode_step_profile.py --out $O/bf16.json > $O/bf16.log 2>&1
head -25 $O/bf16.log | grep -v Warning
tar czf $OUT/run57.tgz -C /tmp run57
echo "done in $SECONDS s"
# Then, on the same warm machine, AWQ again without PDL (each kernel's own time):
#   PAGODA_PDL=0 python benchmarks/decode_step_profile.py --quantization awq \
#     --out awq_nopdl.json > awq_nopdl.log
