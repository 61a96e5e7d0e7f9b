#!/bin/bash
# The next weights asked into L2 during each layer's attention (`pagoda/kernels/l2_prefetch.py`,
# the commit that adds this folder): its GPU tests, then single-stream decode (AWQ and bf16)
# with PAGODA_L2_PREFETCH_MB 0 (off), 24, 40, and 24 plus the next layer's qkv_proj asked for
# after each MLP (`next_qkv/`), and the 8-bit step table at 256 and 512 rows (the row
# quantization launched plainly), in the order below, as time allows (LIMIT seconds, default
# 560). Writes $OUT/run82.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
O=/tmp/run82 && mkdir -p $O
trap 'tar czf $OUT/run82.tgz -C /tmp run82' EXIT
left() { [ $((${LIMIT:-560} - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_l2_prefetch.py \
  tests/engine/test_gpu_engine.py -k prefetch -rf 2>&1 \
  | grep -E "FAILED|Error|passed|failed" | cut -c1-300 > $O/tests.log
tail -3 $O/tests.log
R=$B/results/h200/run82-l2-prefetch
b() {  # b QUANT MIB|next [SUFFIX]: single-stream decode, its tok/s line
  left 50 "b $1 $2" || return
  flag=$([ $1 = bf16 ] || echo "--quantization $1")
  P=$([ $2 = next ] && echo $R/next_qkv)
  PYTHONPATH=$P PAGODA_L2_PREFETCH_MB=${2/next/24} OUT=/tmp/b timeout 70 \
    python $B/h200_bench.py --only b $flag > $O/b_$1_$2$3.log 2>&1
  echo "b $1 $2 MiB$3: $(grep -E '^b Pagoda decode tok/s' $O/b_$1_$2$3.log | tr -s ' ')"
}
b awq 0; b awq 24; b awq next; b bf16 0; b bf16 24
left 45 "w8a8 table" && timeout 45 python $B/w8a8_bench.py --m 256,512 \
  --out $O/w8a8.json 2>&1 | grep -v Warn > $O/w8a8.log
grep -E "^ +[0-9]+ \|" $O/w8a8.log | cut -c1-300
b awq 40; b bf16 next; b awq 0 _2; b awq 24 _2; b bf16 40
echo "done in $SECONDS s"
