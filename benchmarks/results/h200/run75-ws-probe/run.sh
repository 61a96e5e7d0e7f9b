#!/bin/bash
# Why the warp-specialized W4A16 kernel is slower than the rule (run 74): deeper weight
# prefetch (depth 8 in registers, or a ring of 8-16 stages in shared memory by cp.async),
# timed against the rule (probe.py), after the kernel's GPU tests; then Nsight Compute
# on two configs of gate_up (stall reasons, and the SASS lines where the warps stall).
# Writes $OUT/run75.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run75 && mkdir -p $O
trap 'tar czf $OUT/run75.tgz -C /tmp run75' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 120 python -m pytest -q -x -m gpu tests/kernels/test_w4a16_ws.py -p no:cacheprovider \
  > $O/tests.log 2>&1
echo "tests rc=$?"; tail -5 $O/tests.log | cut -c1-300
timeout 200 python benchmarks/results/h200/run75-ws-probe/probe.py 128,1,1,4,4,0,2 \
  128,1,1,4,8,0,2 128,1,1,3,4,0,2,8 128,1,1,3,4,0,2,16 128,2,1,7,4 128,2,1,4,2,0,1,16 \
  256,2,1,4,4 256,2,1,4,8 256,2,1,3,4,0,1,12 256,1,2,5,8 64,1,1,6,4,0,2 64,1,1,4,4,0,2,16 \
  2>&1 | grep -v Warn | tee $O/probe.log
NCU="ncu --clock-control none --kernel-name pagoda_w4a16_ws --launch-skip 4 --launch-count 1"
S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy"
S="$S --section MemoryWorkloadAnalysis --section SourceCounters"
for job in "gate_up 128 128,1,1,4,4,0,2" "gate_up 256 256,2,1,4,4"; do
  set -- $job
  timeout 120 $NCU $S python benchmarks/w4a16_gemv_profile.py --shape $1 --m $2 --ws $3 \
    > $O/ncu_$1_$2.txt 2>&1
  grep -E "Duration|Throughput|Issued Ipc|Achieved Occupancy|Stall|Registers|No Eligible|Warp Cycles|L2 Hit|Bandwidth" \
    $O/ncu_$1_$2.txt | head -40 | cut -c1-200
done
echo "done in $SECONDS s"
