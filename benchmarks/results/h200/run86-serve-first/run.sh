#!/bin/bash
# `pagoda serve` on the GPU first, for a short lease: run 83's `serve_smoke.py` with bf16 and
# with AWQ dummy Llama-3-8B-shape weights, the GPU sampler tests (bad_words among them), then
# `w4a16_step_kernels.py` at 64, 256 and 1 rows as time allows (LIMIT seconds, default 380).
# Needs the wheels of benchmarks/gpu_wheelhouse.sh carried as .whl. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 SMOKE_DIR=$OUT
LIMIT=${LIMIT:-380}
R=benchmarks/results/h200/run83-gpu-check
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 140 python $R/serve_smoke.py 2>&1 | tee $OUT/smoke_bf16.txt
left 90 "serve awq" && timeout 140 python $R/serve_smoke.py --quantization awq 2>&1 \
  | tee $OUT/smoke_awq.txt
left 60 "sampler tests" && timeout 50 python -m pytest -q -p no:cacheprovider -m gpu tests/sample \
  -rf 2>&1 | grep -E "FAILED|ERROR|passed|failed" | cut -c1-400 | tee $OUT/tests.log
left 40 "profile" && timeout $((LIMIT - SECONDS - 5)) python benchmarks/w4a16_step_kernels.py \
  --m 64 256 1 --out $OUT/step_kernels.json > $OUT/step_kernels.log 2>&1
grep -E "^(w4a16|bf16) M=" $OUT/step_kernels.log
echo "done in $SECONDS s"
