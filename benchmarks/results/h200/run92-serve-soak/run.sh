#!/bin/bash
# `pagoda serve` soaked on the GPU (`benchmarks/serve_soak.py`): dummy Llama-3-8B-shape
# weights, AWQ then bf16, rounds of mixed concurrent requests (streams a third of whose clients
# leave midway, n=2 with logprobs, seeded samples, requests to refuse) against a KV cache small
# enough to preempt; then the checks that the server came back to rest. Needs the wheels of
# benchmarks/gpu_wheelhouse.sh carried as .whl. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
M=benchmarks/presets/llama-3-8b/config.json
timeout 280 python benchmarks/serve_soak.py --model $M --dummy --quantization awq \
  --requests 600 --concurrency 96 --max-num-seqs 64 --max-model-len 1024 --blocks 160 \
  --log $OUT/serve_awq.log 2>&1 | tee $OUT/soak_awq.txt
timeout 200 python benchmarks/serve_soak.py --model $M --dummy \
  --requests 300 --concurrency 64 --max-num-seqs 32 --max-model-len 1024 --blocks 96 \
  --log $OUT/serve_bf16.log 2>&1 | tee $OUT/soak_bf16.txt
echo "done in $SECONDS s"
