#!/bin/bash
# The row quantization against a one-pass variant (../run71-next/quant_probe.py), and the 8-bit
# step table at 160-256 rows with PDL off and on (is INT8's slow 160-row step with prequantized
# inputs the programmatic launches' doing?). Writes $OUT/run74.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
O=/tmp/run74 && mkdir -p $O
trap 'tar czf $OUT/run74.tgz -C /tmp run74' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout -k 5 60 python $B/results/h200/run71-next/quant_probe.py 2>&1 | grep -v Warn \
  | tee $O/quant_probe.log
for pdl in 0 1; do
  PAGODA_PDL=$pdl timeout -k 5 35 python $B/w8a8_bench.py --m 160,192,256 \
    --out $O/w8a8_pdl$pdl.json 2>&1 | grep -v Warn > $O/w8a8_pdl$pdl.log
  echo "PAGODA_PDL=$pdl"; grep -E "^ +[0-9]+ \|" $O/w8a8_pdl$pdl.log | cut -c1-200
done
echo "done in $SECONDS s"
