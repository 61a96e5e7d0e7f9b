#!/bin/bash
# The next weights asked into L2 during each layer's attention (`pagoda/kernels/l2_prefetch.py`,
# the commit that adds this folder): its GPU tests, then single-stream decode (AWQ and bf16)
# with PAGODA_L2_PREFETCH_MB 0 (off), 24 and 40 in turn and with 24 plus the next layer's
# qkv_proj asked for after each MLP (`next_qkv/`), then the 8-bit step table at 256-1024
# rows (the row quantization launched plainly). Writes $OUT/run82.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
O=/tmp/run82 && mkdir -p $O
trap 'tar czf $OUT/run82.tgz -C /tmp run82' EXIT
left() { [ $((560 - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_l2_prefetch.py \
  tests/engine/test_gpu_engine.py -k "prefetch or programmatic" -rf 2>&1 \
  | grep -E "FAILED|Error|passed|failed" | cut -c1-300 > $O/tests.log
tail -3 $O/tests.log
R=$B/results/h200/run82-l2-prefetch
for q in awq bf16; do
  for mb in 0 24 40 next; do
    left 50 "b $q $mb" || continue
    flag=$([ $q = bf16 ] || echo "--quantization $q")
    P=$([ $mb = next ] && echo $R/next_qkv)
    PYTHONPATH=$P PAGODA_L2_PREFETCH_MB=${mb/next/24} OUT=/tmp/b timeout 70 \
      python $B/h200_bench.py --only b $flag > $O/b_${q}_$mb.log 2>&1
    echo "b $q $mb MiB: $(grep -E '^b Pagoda decode tok/s' $O/b_${q}_$mb.log | tr -s ' ')"
  done
done
left 60 "w8a8 table" && timeout 60 python $B/w8a8_bench.py --m 256,512,1024 \
  --out $O/w8a8.json 2>&1 | grep -v Warn > $O/w8a8.log
grep -E "^ +[0-9]+ \|" $O/w8a8.log | cut -c1-300
for mb in 0 24; do
  left 50 "b awq $mb again" || continue
  PAGODA_L2_PREFETCH_MB=$mb OUT=/tmp/b timeout 70 python $B/h200_bench.py --only b \
    --quantization awq > $O/b_awq_${mb}_2.log 2>&1
  echo "b awq $mb MiB again: $(grep -E '^b Pagoda decode tok/s' $O/b_awq_${mb}_2.log | tr -s ' ')"
done
echo "done in $SECONDS s"
