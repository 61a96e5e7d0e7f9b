#!/bin/bash
# Ran as part of run 79 (`../run79-check/`, on an H200); its quantization probe and PDL
# table also ran as run77-quant-pdl (H100). #13's figures with the CUDA 8-bit kernel, meant
# for the H200 the targets are set for (ask for `nvidia-h200`; runs 66-77 came on an H100):
# the row quantization against a
# one-pass variant (quant_probe.py), the W8A8 / FP8 step table (and with PDL off at 160-256
# rows), whole W4A16 decode steps, single-stream AWQ / bf16 decode, workload a with FP8 and
# with INT8 weights (FP8 KV cache).
# Parts that would not finish within LIMIT seconds are skipped. Writes $OUT/run71.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
O=/tmp/run71 && mkdir -p $O
trap 'tar czf $OUT/run71.tgz -C /tmp run71' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 60 python $B/results/h200/run71-next/quant_probe.py 2>&1 | grep -v Warn \
  | tee $O/quant_probe.log
left 100 "w8a8 table" && timeout 90 python $B/w8a8_bench.py --m 1,64,128,160,192,256,512,1024 \
  --out $O/w8a8.json 2>&1 | grep -v Warn > $O/w8a8.log
grep -E "^ +[0-9]+ \|" $O/w8a8.log | cut -c1-300
# INT8 at 160 rows is slower with prequantized inputs than without (run 73): PDL's doing?
left 60 "w8a8 pdl=0" && PAGODA_PDL=0 timeout 40 python $B/w8a8_bench.py --m 160,192,256 \
  --out $O/w8a8_pdl0.json 2>&1 | grep -v Warn > $O/w8a8_pdl0.log
grep -E "^ +[0-9]+ \|" $O/w8a8_pdl0.log | cut -c1-300
left 120 "w4a16 steps" && timeout 110 python $B/w4a16_skinny_bench.py --step \
  --m 1 16 64 128 256 --reps 5 --out $O/w4a16_step.json > $O/w4a16_step.log 2>&1
tail -7 $O/w4a16_step.log
for q in awq bf16; do
  left 60 "b $q" || continue
  flag=$([ $q = bf16 ] || echo "--quantization $q")
  OUT=/tmp/b timeout 75 python $B/h200_bench.py --only b $flag > $O/b_$q.log 2>&1
  echo "b $q: $(grep -E '^b Pagoda decode tok/s' $O/b_$q.log | tr -s ' ')"
done
for q in fp8 w8a8; do
  left 90 "a $q" || continue
  OUT=/tmp/a timeout 90 python $B/h200_bench.py --only a --quantization $q \
    --kv-cache-dtypes fp8 > $O/a_$q.log 2>&1
  echo "a $q: $(grep -E '^a Pagoda output tok/s' $O/a_$q.log | tr -s ' ')"
done
echo "done in $SECONDS s"
