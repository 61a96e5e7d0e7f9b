#!/bin/bash
# Thread-block clusters sharing tiles by multicast copies, in the 8-bit CUDA GEMM and the W4A16
# wgmma kernel: a smoke check (stops here if a cluster hangs or is wrong), their GPU tests
# (the W4A16 ones with clusters only), then probe.py (8-bit per layer, int8 and fp8, then
# whole steps with the rule against the best config per layer) and probe_w4.py (the same for
# W4A16). Writes $OUT/run72.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
P=benchmarks/results/h200/run72-w8a8-cluster
O=/tmp/run72 && mkdir -p $O
trap 'tar czf $OUT/run72.tgz -C /tmp run72' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout -k 5 60 python $P/smoke.py 2>&1 | grep -v Warn | tee $O/smoke.log
grep -q "smoke ok" $O/smoke.log || { echo "smoke failed: stop"; exit 1; }
timeout -k 5 60 python -m pytest -q -m gpu tests/kernels/test_w8a8_wgmma.py 2>&1 | tail -8 \
  | tee $O/tests_w8a8.log
timeout -k 5 50 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py -k "cluster" 2>&1 \
  | tail -8 | tee $O/tests_w4.log
PROBE_M=128,192,256,384,512 timeout -k 5 160 python $P/probe.py 2>&1 | grep -v Warn \
  | tee $O/probe.log | cut -c1-330
timeout -k 5 130 python $P/probe_w4.py 2>&1 | grep -v Warn | tee $O/probe_w4.log | cut -c1-330
timeout -k 5 50 python benchmarks/results/h200/run71-next/quant_probe.py 2>&1 | grep -v Warn \
  | tee $O/quant_probe.log
echo "done in $SECONDS s"
