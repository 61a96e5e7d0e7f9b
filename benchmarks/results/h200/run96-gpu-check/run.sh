#!/bin/bash
# The GPU tests outside the kernels (engine, sampler, worker, speculative decoding, models and
# quantized checkpoints among them the Qwen2-MoE / Granite / OLMo 2 families, executor) on the
# tree it runs on.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout ${LIMIT:-280} python -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/sample \
  tests/worker tests/spec_decode tests/model tests/executor -rf 2>&1 \
  | grep -E "FAILED|ERROR|passed|failed" | cut -c1-400 | tee $OUT/tests.log
echo "done in $SECONDS s"
