#!/bin/bash
# The GEMV's stall samples per SASS instruction (Nsight Compute's source page), gate_up and
# qkv at 1 row: which waits the long-scoreboard samples sit on. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
R=benchmarks/results/h200/run89-ncu
for job in "gate_up 1" "qkv 1"; do
  set -- $job
  timeout 150 ncu --profile-from-start off -k regex:pagoda -c 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass \
    python $R/one_gemm.py $1 $2 1 > $OUT/sass_$1_$2.txt 2>&1
  echo "== $job $(wc -l < $OUT/sass_$1_$2.txt) lines"; head -5 $OUT/sass_$1_$2.txt | cut -c1-200
done
