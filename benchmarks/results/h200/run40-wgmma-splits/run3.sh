#!/bin/bash
# Not yet run. Nsight Compute on the bulk-copy wgmma kernel where it trails cuBLAS most at
# 256 rows (qkv, o, down with the rule's configs) and where it beats it (gate_up): where its
# warps stall now that no barrier spans the CTA. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
NCU="ncu --clock-control none --kernel-name pagoda_w4a16_wgmma --launch-skip 4 --launch-count 1"
S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy"
S="$S --section LaunchStats --section MemoryWorkloadAnalysis"
for job in "qkv 256 64,1,4,4,0,1,1" "o 256 64,1,4,4,0,2,1" "down 256 64,4,4,2,0,1,1" \
  "gate_up 256 256,2,3,2,0,1,1"; do
  set -- $job
  timeout 100 $NCU $S python benchmarks/w4a16_gemv_profile.py --shape $1 --m $2 --wgmma $3 \
    > $OUT/ncu_$1_$2.txt 2>&1
  echo "== $1 $2 $3"
  grep -E "Duration|Throughput|Issued Ipc|Achieved Occupancy|Stall|Registers|No Eligible|Warp Cycles|Waves" \
    $OUT/ncu_$1_$2.txt | head -24
done
