#!/bin/bash
# The GPU tests outside the kernels (engine, sampler, worker, speculative decoding, models and
# quantized checkpoints among them the Qwen2-MoE / Granite / OLMo 2 families, executor) on the
# tree it runs on; then, on an H200, single-stream AWQ decode with the scale prefetch.
cd "$(dirname "$0")/../../../.." || exit 1
# the wheels of benchmarks/gpu_wheelhouse.sh, carried as .whl (the GGUF tests import gguf)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt)
echo "$gpu"
timeout ${TESTS_S:-240} python -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/sample \
  tests/worker tests/spec_decode tests/model tests/executor -rf 2>&1 \
  | grep -E "FAILED|ERROR|passed|failed" | cut -c1-400 | tee $OUT/tests.log
if [[ $gpu == *H200* ]]; then
  OUT=/tmp/b timeout 80 python benchmarks/h200_bench.py --only b --quantization awq \
    > $OUT/b_awq.log 2>&1
  echo "b awq: $(grep -E '^b Pagoda decode tok/s' $OUT/b_awq.log | tr -s ' ')"
fi
echo "done in $SECONDS s"
