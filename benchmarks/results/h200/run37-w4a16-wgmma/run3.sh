#!/bin/bash
# Nsight Compute on the wgmma kernel: o at 64 rows (2 us a K step) and gate_up at 1024 rows
# (half of cuBLAS's tensor rate): where its warps stall. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
NCU="ncu --clock-control none --kernel-name pagoda_w4a16_wgmma --launch-skip 4 --launch-count 1"
S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for job in "o 64 64,1,4,2,0" "gate_up 1024 128,2,4,2,0"; do
  set -- $job
  timeout 100 $NCU $S python benchmarks/w4a16_gemv_profile.py --shape $1 --m $2 --wgmma $3 \
    > $OUT/ncu_$1_$2.txt 2>&1
  grep -E "Duration|Throughput|Issued Ipc|Achieved Occupancy|Stall|Registers|No Eligible|Warp Cycles" \
    $OUT/ncu_$1_$2.txt | head -30
done
