#!/bin/bash
# Not yet run. Where the wgmma kernel's warps stall, instruction by instruction: Nsight
# Compute's warp-state sampling (SourceCounters: the SASS lines with the most samples and
# their stall reasons) for o and down at 256 rows and gate_up at 256 rows with the rule's
# configs, and the raw per-instruction samples as CSV. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
NCU="ncu --clock-control none --kernel-name pagoda_w4a16_wgmma --launch-skip 4 --launch-count 1"
for job in "o 256 64,1,4,4,0,2,1" "down 256 64,4,4,2,0,1,1" "gate_up 256 256,2,3,2,0,1,1"; do
  set -- $job
  timeout 120 $NCU --section SourceCounters --section WarpStateStats -o $OUT/src_$1 \
    python benchmarks/w4a16_gemv_profile.py --shape $1 --m $2 --wgmma $3 > /dev/null 2>&1
  ncu --import $OUT/src_$1.ncu-rep --page source --csv --print-source sass \
    > $OUT/sass_$1.csv 2>/dev/null
  echo "== $1 $2 $3"
  ncu --import $OUT/src_$1.ncu-rep --section SourceCounters 2>/dev/null | grep -A14 "Warp Stall Sampling" | head -16
done
echo "done in $SECONDS s"
