#!/bin/bash
# Host time per eager W4A16 call against F.linear (`host.py`), the kernels of a single-stream
# AWQ decode step (`runner_step_bench.py --profile 1`); then, with the time left, the
# GEMV rule (tuned on the H100) on this GPU: the CUDA configs swept at 1-16 rows against
# `gemv_config`'s, and whole steps. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
R=$B/results/h200/run43-gemv-h200
LIMIT=${LIMIT:-240}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python $R/host.py > $OUT/host.log 2>&1; tail -22 $OUT/host.log
# Where a single-stream AWQ decode step's time goes (the kernels between the GEMVs: which to fuse).
timeout 90 python $B/runner_step_bench.py --model $B/presets/llama-3-8b/config.json \
  --device cuda --dtype bfloat16 --quantization awq --batch 1 --prefill --graphs on \
  --profile 1 --iters 20 > $OUT/profile.log 2>&1; grep -A25 "decode batch" $OUT/profile.log | head -30
left 30 step && timeout 40 python $B/w4a16_skinny_bench.py --step --m 1 2 4 8 12 16 --reps 10 \
  > $OUT/step.log 2>&1; tail -7 $OUT/step.log | cut -c1-50
left 60 sweep && timeout $((LIMIT - SECONDS)) python $B/w4a16_skinny_bench.py --m 1 4 8 16 \
  --no-sweep --no-wgmma-sweep --reps 10 --out $OUT/sweep.json > $OUT/sweep.log 2>&1
[ -s $OUT/sweep.json ] && python $B/w4a16_skinny_bench.py --top 2 --family cuda --out $OUT/sweep.json
echo "done in $SECONDS s"
