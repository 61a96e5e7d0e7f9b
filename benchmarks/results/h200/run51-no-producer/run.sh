#!/bin/bash
# Run on an H100 (README.md). Nsight Compute (run 50) found the ring GEMV latency-bound at 3
# CTAs an SM (12 consumer warps; registers and shared memory both bound it) and the ring without a producer
# warp no better, held to 3 CTAs by both as well. Now that variant keeps to 128 registers
# (launch bounds) and every bulk config asks for the shared memory its registers allow
# (`cuda_launch.fit_shared_carveout`); and the rule's ring held to the registers of 20
# resident warps an SM (`GemvConfig.min_warps`: gate_up's 5-warp CTAs 4 an SM at 96
# registers). The GEMV's GPU tests; whole steps at 1-16 rows for the three (in one process,
# in turn twice); Nsight Compute's occupancy of gate_up at 1 row for the two new ones, time
# left (LIMIT, 150 s by default).
# Writes $OUT/run51.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run51 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py -rf --maxfail=10 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $O/tests.log
tail -4 $O/tests.log
V="0 0,2,0 0,2,1,20"
grep -q "FAILED.*without_producer" $O/tests.log && V="0 0,2,1,20"
timeout 90 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 --gemv-variants $V \
  --reps 5 --out $O/variants.json > $O/variants.log 2>&1
tail -6 $O/variants.log
NCU="ncu --clock-control none --kernel-name pagoda_w4a16_gemv --launch-skip 4 --launch-count 1"
NCU="$NCU --section SpeedOfLight --section Occupancy --section LaunchStats"
for cfg in 2,4,2,0,1,1,1,2,8,1,0,0,0 2,4,2,0,1,1,1,2,8,1,0,1,20; do
  [ $SECONDS -gt ${LIMIT:-150} ] && break
  timeout 60 $NCU python benchmarks/w4a16_gemv_profile.py --shape gate_up --m 1 --config $cfg \
    > $O/ncu_$cfg.txt 2>&1
  echo "== gate_up $cfg"
  grep -E "Duration|DRAM Throughput|Registers Per Thread|Block Limit|Theoretical Occ|Achieved Occ" $O/ncu_$cfg.txt
done
tar czf $OUT/run51.tgz -C /tmp run51
echo "done in $SECONDS s"
