#!/bin/bash
# The per-token row quantization launched plainly (the code of the commit that
# adds this folder) against as a programmatic dependent (`quant_pdl/`, as before), in one
# call: the 8-bit table, then single-stream FP8 decode. Writes $OUT/run81.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
R=benchmarks/results/h200/run81-quant-plain
O=/tmp/run81 && mkdir -p $O
trap 'tar czf $OUT/run81.tgz -C /tmp run81' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
for v in plain quant_pdl plain quant_pdl; do
  P=$([ $v = plain ] || echo $R/$v)
  PYTHONPATH=$P timeout 60 python benchmarks/w8a8_bench.py --m 1,64,128,160,192,256,512 2>&1 \
    | grep -v Warn >> $O/w8a8_$v.log
  echo "$v"; grep -E "^ +[0-9]+ \|" $O/w8a8_$v.log | tail -7 | cut -c1-120
done
for v in plain quant_pdl; do
  [ $SECONDS -lt 200 ] || { echo "skipped (time): b $v"; continue; }
  P=$([ $v = plain ] || echo $R/$v)
  PYTHONPATH=$P OUT=/tmp/b timeout 80 python benchmarks/h200_bench.py --only b \
    --quantization fp8 >> $O/b_$v.log 2>&1
  echo "b fp8 $v: $(grep -E '^b Pagoda decode tok/s' $O/b_$v.log | tail -1 | tr -s ' ')"
done
echo "done in $SECONDS s"
