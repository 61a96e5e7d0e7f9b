#!/bin/bash
# Two open questions of the 8-bit path, in one call: the row quantization against a one-pass
# variant (run71-next/quant_probe.py), and INT8 at 160-256 rows with programmatic dependent
# launch on and off (prequantized inputs were slower than quantizing per layer at 160 rows in
# run 73: is PDL the cause?). Writes $OUT/run77.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run77 && mkdir -p $O
trap 'tar czf $OUT/run77.tgz -C /tmp run77' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 60 python benchmarks/results/h200/run71-next/quant_probe.py 2>&1 | grep -v Warn \
  | tee $O/quant_probe.log
for pdl in 1 0; do
  PAGODA_PDL=$pdl timeout 60 python benchmarks/w8a8_bench.py --m 160,192,256 \
    --out $O/w8a8_pdl$pdl.json 2>&1 | grep -v Warn > $O/w8a8_pdl$pdl.log
  echo "PAGODA_PDL=$pdl"; grep -E "^ +[0-9]+ \|" $O/w8a8_pdl$pdl.log | cut -c1-300
done
echo "done in $SECONDS s"
