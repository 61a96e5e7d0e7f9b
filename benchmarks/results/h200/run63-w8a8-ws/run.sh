#!/bin/bash
# Ran with a working tree not kept (`W8A8Config.warp_spec`, dropped: README.md). The
# warp-specialized TMA configs of the 8-bit GEMM (`W8A8Config.warp_spec`: a producer warp
# group and two consumers, Triton's Hopper warp specialization) on the GPU: their tests, then
# the sweep at 128-1024 rows with them among the candidates. Writes $OUT/run63.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run63 && mkdir -p $O
trap 'tar czf $OUT/run63.tgz -C /tmp run63' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_scaled_mm.py \
  -k "tma or configs_agree" -m "gpu or not slow" -rf 2>&1 | grep -E "FAILED|passed|failed" \
  | cut -c1-300 > $O/tests.log
tail -3 $O/tests.log
timeout 360 python benchmarks/w8a8_bench.py --sweep --m 128,256,512,1024 --budget-s 240 \
  --out $O/sweep.json 2>&1 | grep -v Warn > $O/sweep.log
grep -E "per step|^M=|failed|Error" $O/sweep.log | tail -14
echo "done in $SECONDS s"
