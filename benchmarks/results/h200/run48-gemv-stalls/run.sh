#!/bin/bash
# Run on an H200: results in ../run50-h200-ring/48/. Where the ring GEMV's warps wait at 1 row (it reads the packed weights at ~2.1
# TB/s on the H200, half the copy rate, and only 5-9% faster than on the H100: latency, not
# bandwidth): Nsight Compute's speed of light, warp states and warp-state sampling per SASS
# instruction (SourceCounters) for gate_up and qkv with the rule's configs, each also with its
# scales and zero points through the ring (sc_ring) (GemvConfig fields: row_tiles, warps,
# depth, l2_prefetch, sum_mma, x_early, bulk, stages, chunk, pdl, sc_ring). Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
NCU="ncu --clock-control none --kernel-name pagoda_w4a16_gemv --launch-skip 4 --launch-count 1"
NCU="$NCU --section SpeedOfLight --section WarpStateStats --section SchedulerStats"
NCU="$NCU --section Occupancy --section SourceCounters --section ComputeWorkloadAnalysis"
# The pipes' share of their peak (ALU: LOP3, SHF, ISETP...; FMA: FFMA, IMAD, HADD2...), in a
# second pass of its own, so that a metric this ncu lacks costs only that pass.
PIPES=sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
PIPES=$PIPES,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
PIPES=$PIPES,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.avg.per_cycle_active
for job in "gate_up rule" "gate_up 2,4,2,0,1,1,1,2,8,1,1" "gate_up 2,4,2,0,1,1,1,2,8,1,1,0" "qkv rule" \
  "qkv 2,8,2,0,0,1,1,2,16,1,1"; do
  set -- $job
  cfg=(); [ "$2" != rule ] && cfg=(--config "$2")
  name=$1_${2//,/}
  timeout 90 $NCU -o $OUT/$name python benchmarks/w4a16_gemv_profile.py --shape $1 --m 1 \
    "${cfg[@]}" > $OUT/$name.log 2>&1
  ncu --import $OUT/$name.ncu-rep --page source --csv --print-source sass > $OUT/sass_$name.csv 2>/dev/null
  ncu --import $OUT/$name.ncu-rep > $OUT/$name.txt 2>/dev/null
  timeout 60 ${NCU%% --section*} --metrics $PIPES python benchmarks/w4a16_gemv_profile.py \
    --shape $1 --m 1 "${cfg[@]}" 2>&1 | grep -E "pipe|inst_executed|ERROR" > $OUT/pipes_$name.txt
  echo "== $job: $(grep -E '^(gate_up|qkv) M=' $OUT/$name.log)"
  grep -E "Duration|DRAM Throughput|Issued Warp Per Scheduler|No Eligible|Achieved Occupancy|Warp Cycles Per Issued" $OUT/$name.txt
  grep -A14 "Warp Stall Sampling" $OUT/$name.txt | head -16
  cat $OUT/pipes_$name.txt
done
echo "done in $SECONDS s"
