#!/bin/bash
# Never run: run 80 (`../run80-pdl-order/`) answered its question, with the row
# quantization without PDL among its variants. Was: which kernel's programmatic dependent
# launch costs INT8 with fused quantization 0.39 ms a step at 160 rows (run 77): the 8-bit
# table at 160-256 rows with every kernel as the default says, with the row quantization
# launched without PDL, and with the CUDA GEMM without it (`<variant>/sitecustomize.py` on
# PYTHONPATH), in one call. Writes $OUT/run78.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
R=benchmarks/results/h200/run78-pdl-parts
O=/tmp/run78 && mkdir -p $O
trap 'tar czf $OUT/run78.tgz -C /tmp run78' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
for v in default quant_no_pdl gemm_no_pdl default; do
  P=$([ $v = default ] || echo $R/$v)
  PYTHONPATH=$P timeout 60 python benchmarks/w8a8_bench.py --m 160,192,256 2>&1 | grep -v Warn \
    >> $O/w8a8_$v.log
  echo "$v"; grep -E "^ +[0-9]+ \|" $O/w8a8_$v.log | tail -3 | cut -c1-200
done
echo "done in $SECONDS s"
