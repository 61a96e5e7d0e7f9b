#!/usr/bin/env bash
# Run the kernel tests natively on a CUDA GPU, then the kernel micro-benchmark.
# Without a GPU the same tests run under TRITON_INTERPRET=1 (float32) and the gpu-marked ones
# skip; on a GPU the float32 tests compile for real and the gpu-marked bf16/fp16 ones run too.
#   tests/kernels/run_on_gpu.sh            # tests + quick benchmark
#   tests/kernels/run_on_gpu.sh --full     # tests + full benchmark table (+ JSON)
set -euo pipefail
cd "$(dirname "$0")/../.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')"
unset TRITON_INTERPRET
python -m pytest tests/kernels -m "not slow" -q -p no:cacheprovider
out="${OUT:-.}"
if [[ "${1:-}" == "--full" ]]; then
  python benchmarks/gpu_kernels.py --sweep --json "$out/gpu_kernels.json"
else
  python benchmarks/gpu_kernels.py --quick --json "$out/gpu_kernels_quick.json"
fi
