#!/bin/bash
# The warp-specialized W4A16 kernel with consumers that read the unpacked weights into
# registers (ldmatrix, wgmma with A from registers: no async-proxy fence after each stage's
# stores, `WsConfig.a_regs`) against the same configs with A from shared memory, the rule and
# bf16 cuBLAS (run 75's probe.py), after the kernel's GPU tests. Writes $OUT/run76.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run76 && mkdir -p $O
trap 'tar czf $OUT/run76.tgz -C /tmp run76' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 150 python -m pytest -q -x -m gpu tests/kernels/test_w4a16_ws.py -p no:cacheprovider \
  > $O/tests.log 2>&1
echo "tests rc=$?"; tail -5 $O/tests.log | cut -c1-300
timeout 240 python benchmarks/results/h200/run75-ws-probe/probe.py \
  128,1,1,4,4,0,2 128,1,1,4,4,0,2,0,1 128,1,1,3,4,0,2,16 128,1,1,3,4,0,2,16,1 \
  128,2,1,4,2,0,1,16 128,2,1,4,2,0,1,16,1 256,2,1,3,4,0,1,12 256,1,2,5,8 256,1,2,5,8,0,1,0,1 \
  256,1,2,3,4,0,1,12,1 64,1,1,4,4,0,2,16 64,1,1,4,4,0,2,16,1 \
  2>&1 | grep -v Warn | tee $O/probe.log
echo "done in $SECONDS s"
