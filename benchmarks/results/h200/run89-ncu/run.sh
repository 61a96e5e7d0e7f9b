#!/bin/bash
# Nsight Compute on single W4A16 GEMMs (where ncu exists and may read the counters): the
# wgmma kernel at 64 and 256 rows (qkv, gate_up) and the GEMV at 1 row (gate_up): speed of
# light, warp stall reasons, memory and compute pipes. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
R=benchmarks/results/h200/run89-ncu
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"; [ -n "$NCU" ] || exit 0
for job in "qkv 64" "gate_up 64" "gate_up 256" "qkv 256" "gate_up 1"; do
  set -- $job
  timeout 100 $NCU --profile-from-start off -k regex:pagoda -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \
    --section LaunchStats python $R/one_gemm.py $1 $2 > $OUT/ncu_$1_$2.txt 2>&1
  echo "== $1 $2"; grep -E "Duration|Throughput|Stall|Warp Cycles|Issued|Eligible|Occupancy|Registers|L2 Hit|Executed Ipc|Pipe|ERR|error" $OUT/ncu_$1_$2.txt | head -40
done
echo "done in $SECONDS s"
