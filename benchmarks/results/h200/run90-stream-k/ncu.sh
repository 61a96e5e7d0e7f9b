#!/bin/bash
# Nsight Compute on gate_up and qkv at 256 rows: the same tiles on the grid of tiles and on
# the Stream-K grid (run 90's sweep: 100.7 against 129.3 us for gate_up). Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
R=benchmarks/results/h200/run89-ncu
for job in "gate_up 256 WgmmaConfig(bn=256,stages=3,a_buffers=1)" \
  "gate_up 256 WgmmaConfig(bn=256,stages=3,a_buffers=1,stream_k=1)" \
  "qkv 256 WgmmaConfig(bn=128,stream_k=1)" "qkv 256 WgmmaConfig(bn=128)"; do
  set -- $job
  f=$OUT/ncu_$1_$2_$(echo $3 | tr -dc 'a-z0-9_').txt
  timeout 120 ncu --profile-from-start off -k regex:pagoda -c 1 --set full \
    python $R/one_gemm.py $1 $2 1 "$3" > $f 2>&1
  echo "== $job"
  grep -E "\(.*\)x\(|Elapsed Cycles|SM Active Cycles|Duration|Issue Slots Busy|DRAM Throughput|L2 Hit Rate|Local Memory|Stall|smsp__pcsamp" $f | head -24
done
