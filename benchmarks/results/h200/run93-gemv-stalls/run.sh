#!/bin/bash
# Where the W4A16 GEMV's warps wait (Nsight Compute, the full set, raw metrics): gate_up, qkv
# and down at 1 row and gate_up at 16 rows by the rule, each warp-state's share of the stall
# samples, with the memory and issue figures. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
R=benchmarks/results/h200/run89-ncu
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for job in "gate_up 1" "qkv 1" "down 1" "gate_up 16"; do
  set -- $job
  f=$OUT/ncu_$1_$2.txt
  timeout 120 ncu --profile-from-start off -k regex:pagoda -c 1 --set full --page raw \
    python $R/one_gemm.py $1 $2 1 > $f 2>&1
  echo "== $job"
  grep -E "gpu__time_duration.sum |dram__throughput.avg.pct_of_peak_sustained_elapsed |sm__warps_active.avg.per_cycle_active |smsp__issue_active.avg.pct_of_peak_sustained_active |launch__registers_per_thread |launch__grid_size " $f | tr -s ' '
  grep -E "smsp__pcsamp_warps_issue_stalled_[a-z_]+ " $f | tr -s ' ' | sort -k3 -n -r | head -8
done
echo "done in $SECONDS s"
