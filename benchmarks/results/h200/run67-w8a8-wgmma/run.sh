#!/bin/bash
# The int8 wgmma kernel's first GPU run: checks (against plain_quantized_mm), then per-layer
# timings against the Triton rule, then the GPU tests of the 8-bit path. Writes $OUT/run67.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
D=benchmarks/results/h200/run67-w8a8-wgmma
O=/tmp/run67 && mkdir -p $O
trap 'tar czf $OUT/run67.tgz -C /tmp run67' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 120 python $D/probe.py check 2>&1 | grep -v Warn | tee $O/check.log
grep -q "checks took" $O/check.log || { echo "checks did not finish"; exit 1; }
timeout 200 python -m pytest -q -m gpu tests/kernels/test_w8a8_wgmma.py -x 2>&1 | tail -15 \
  | tee $O/tests.log
timeout 300 python $D/probe.py time 2>&1 | grep -v Warn | tee $O/time.log
