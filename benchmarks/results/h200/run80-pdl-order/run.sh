#!/bin/bash
# Does a Triton kernel letting the next one launch before it waits for its own
# predecessor (`triton_pdl.dependent_start`) make chains of short kernels slower? A chain of
# row quantizations ran 1.5-1.9x slower with PDL (runs 77, 79), and INT8 at 160 rows 0.11-0.39
# ms a step. The 8-bit table at 160-256 rows and single-stream AWQ decode, each with the
# default order, with the row quantization without PDL (`../run78-pdl-parts/quant_no_pdl`),
# with scaled_mm_triton's kernels waiting first (`smt_wait_first/`) and with every Triton
# kernel waiting first (`all_wait_first/`). Writes $OUT/run80.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
R=benchmarks/results/h200
O=/tmp/run80 && mkdir -p $O
trap 'tar czf $OUT/run80.tgz -C /tmp run80' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
for v in default run78-pdl-parts/quant_no_pdl run80-pdl-order/smt_wait_first \
  run80-pdl-order/all_wait_first default; do
  P=$([ $v = default ] || echo $R/$v) && n=$(basename $v)
  PYTHONPATH=$P timeout 60 python benchmarks/w8a8_bench.py --m 1,160,192,256 2>&1 \
    | grep -v Warn >> $O/w8a8_$n.log
  echo "$n"; grep -E "^ +[0-9]+ \|" $O/w8a8_$n.log | tail -4 | cut -c1-120
done
for v in default run80-pdl-order/all_wait_first default; do
  [ $SECONDS -lt 330 ] || { echo "skipped (time): b $v"; continue; }
  P=$([ $v = default ] || echo $R/$v) && n=$(basename $v)
  PYTHONPATH=$P OUT=/tmp/b timeout 80 python benchmarks/h200_bench.py --only b \
    --quantization awq >> $O/b_$n.log 2>&1
  echo "b $n: $(grep -E '^b Pagoda decode tok/s' $O/b_$n.log | tail -1 | tr -s ' ')"
done
echo "done in $SECONDS s"
