#!/bin/bash
# The GPU tests of the 8-bit path under PDL (run 61's timed out on a cold
# machine), then the step table (`w8a8_bench.py`, the _fq columns) and workload a with FP8 and
# INT8 weights and an FP8 KV cache (`run3.sh`), all with the quantization in RMSNorm / SiLU-and-mul and
# the GEMM under PDL. Writes $OUT/run62.tgz. `run2.sh`: the sweep with the TMA configs.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run62 && mkdir -p $O
trap 'tar czf $OUT/run62.tgz -C /tmp run62' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 380 python -m pytest -q -p no:cacheprovider tests/kernels/test_scaled_mm.py \
  tests/kernels/test_fused_ops.py tests/model/test_w8a8.py -m "gpu or not slow" -rf 2>&1 \
  | grep -E "FAILED|passed|failed" | cut -c1-300 > $O/tests.log
tail -3 $O/tests.log
grep -q "passed" $O/tests.log && ! grep -q "FAILED" $O/tests.log || exit 1
timeout 120 python benchmarks/w8a8_bench.py --m 1,16,64,128,256,512,1024 --out $O/w8a8.json \
  2>&1 | grep -v Warn | tee $O/w8a8.log | grep -v configs
echo "done in $SECONDS s"
