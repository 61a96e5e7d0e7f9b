#!/bin/bash
# The H200 run of the CUDA W4A16 kernel's programmatic dependent launch and bulk ring: GPU
# tests, whole decode steps, end to end single stream (PDL on and off), the config sweep at
# 1-16 rows, a profile of one single-stream AWQ decode step, and Nsight Compute counters of
# the default kernel. Writes to $OUT; the most needed parts first.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
  timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py 2>&1 | tail -25
} > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 120 python $B/w4a16_skinny_bench.py --step --m 1 4 8 16 32 64 --reps 10 \
  --out $OUT/step.json > $OUT/step.log 2>&1; tail -8 $OUT/step.log
{ timeout 75 python $B/h200_bench.py --only b --quantization awq 2>&1 | tail -6
  PAGODA_PDL=0 timeout 75 python $B/h200_bench.py --only b --quantization awq 2>&1 | tail -6
} > $OUT/e2e.log; grep "decode tok/s" $OUT/e2e.log
timeout 200 python $B/w4a16_skinny_bench.py --m 1 4 8 16 --no-sweep --reps 10 \
  --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -7 $OUT/sweep.log
timeout 90 python $B/runner_step_bench.py --model $B/presets/llama-3-8b/config.json \
  --device cuda --dtype bfloat16 --quantization awq --batch 1 --prefill --graphs on \
  --profile 1 --iters 20 > $OUT/profile.log 2>&1; grep "decode batch" $OUT/profile.log
NCU="ncu --clock-control none --kernel-name pagoda_w4a16_gemv --launch-skip 4 --launch-count 1"
NCU="$NCU --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis"
NCU="$NCU --section Occupancy --section LaunchStats"
{ for shape in gate_up o; do timeout 40 $NCU python $B/w4a16_gemv_profile.py --shape $shape --m 1; done
} > $OUT/ncu.txt 2>&1; grep -E "DRAM Throughput|Duration|Issued Ipc|Achieved Occupancy" $OUT/ncu.txt
