#!/bin/bash
# Where the wgmma kernel's time goes: whole steps with the unpacking cut to its LOP3s
# (PAGODA_AB_VARIANT=1), the wgmmas replaced by FADDs (2), no weight loads past the first
# DEPTH steps (3), against the kernel (0); then Nsight Compute's stall reasons at 256 rows.
# Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
for v in 0 1 2 3; do
  echo "== variant $v"
  PAGODA_AB_VARIANT=$v timeout 60 python benchmarks/w4a16_skinny_bench.py --step --m 64 128 256 512 \
    --reps 5 > $OUT/step_v$v.log 2>&1
  grep -A5 "wgmma 64" $OUT/step_v$v.log | head -6
done
NCU="ncu --clock-control none --kernel-name pagoda_w4a16_wgmma --launch-skip 4 --launch-count 1"
M="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
for job in "o 256 64,1,4,4,0,2,1" "gate_up 256 256,2,3,2,0,1,1" "down 256 64,4,4,2,0,1,1" \
  "qkv 64 128,1,4,2,0,2,1"; do
  set -- $job
  timeout 60 $NCU $M python benchmarks/w4a16_gemv_profile.py --shape $1 --m $2 --wgmma $3 \
    > $OUT/stall_$1_$2.txt 2>&1
  echo "== $1 $2 $3"
  grep -E "stalled|issue_active|gmma|duration" $OUT/stall_$1_$2.txt | awk '$NF+0 > 0.05 || /duration|issue_active|gmma/' | sed 's/smsp__average_warps_issue_stalled_//' | head -24
done
echo "done in $SECONDS s"
