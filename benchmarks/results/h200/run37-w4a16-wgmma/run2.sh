#!/bin/bash
# The wgmma kernel's sweep again with 6 stages as well as 4 (x copied 4 K steps ahead instead
# of 2): is it waiting on its x tiles? Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
timeout 200 python benchmarks/w4a16_skinny_bench.py --m 64 128 256 1024 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -7 $OUT/sweep.log
