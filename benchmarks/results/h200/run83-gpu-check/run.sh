#!/bin/bash
# A GPU check of the engine, server and model code after the CPU-side changes of the tree it
# runs on (metrics, quantized tensor-parallel loading, sampling parameters, checkpoint checks):
# the GPU tests outside the kernels, `pagoda serve` on CUDA (serve_smoke.py, bf16 and AWQ,
# dummy Llama-3-8B shape), then the kernels' GPU tests as time allows (LIMIT seconds, default
# 560). Needs the wheels of benchmarks/gpu_wheelhouse.sh carried as .whl. Writes $OUT/run83.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
R=benchmarks/results/h200/run83-gpu-check
O=/tmp/run83 && mkdir -p $O
trap 'tar czf $OUT/run83.tgz -C /tmp run83' EXIT
left() { [ $((${LIMIT:-560} - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
T=$((${LIMIT:-560} - 130)); [ $T -gt 200 ] && T=200  # leave a server check its time
timeout $T python -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/sample tests/worker \
  tests/spec_decode tests/model tests/executor -rf 2>&1 \
  | grep -E "FAILED|ERROR|passed|failed" | cut -c1-400 > $O/tests.log
tail -5 $O/tests.log
left 100 "serve bf16" && timeout 140 python $R/serve_smoke.py 2>&1 | tee $O/smoke_bf16.txt
left 100 "serve awq" && timeout 140 python $R/serve_smoke.py --quantization awq 2>&1 \
  | tee $O/smoke_awq.txt
left 40 "kernel tests" && timeout $((${LIMIT:-560} - SECONDS - 15)) python -m pytest -q \
  -p no:cacheprovider -m gpu tests/kernels -rf 2>&1 | grep -E "FAILED|ERROR|passed|failed" \
  | cut -c1-400 > $O/kernels.log
tail -5 $O/kernels.log
echo "done in $SECONDS s"
