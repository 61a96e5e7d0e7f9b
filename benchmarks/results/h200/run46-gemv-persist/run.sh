#!/bin/bash
# Not yet run. The ring GEMV as a persistent grid (`GemvConfig.persist`: a CTA takes tiles in
# turn, its ring streaming across them, so an SM's loads overlap its mmas instead of a wave of
# CTAs all loading, then all computing), its scales and zero points through the ring
# (`GemvConfig.sc_ring`: 13-23% fewer instructions a K step in the sm_90 builds, no global
# loads in the consumers' loop), deeper rings (3-4 stages: on the H200 the GEMV ran only 5-9%
# faster than on the H100, as if the bytes in flight, not the bandwidth, bound it), and the
# wgmma rule refit on run 44's sweep (o and qkv at 33-64 rows, down at 161-256). In order of
# need: the GEMV's GPU tests; whole steps at 1-16 rows with the rule as it is and these
# variants (`--gemv-variants`: w4a16.GEMV_PERSIST / GEMV_SC_RING / GEMV_STAGES set in one
# process, the variants in turn twice); whole steps at 33-512 rows (compare with run 44 on an
# H100, run 42's h200-baseline on an H200); single-stream AWQ decode (`h200_bench.py --only
# b`) with the rule as it is and with the variant fastest at 1 row; the wgmma kernel's GPU
# tests; the persistent / sc_ring sweep at 1-16 rows against the rule's configs; qkv at 24-32
# rows, the Triton few-row kernel (16.5 us at 32 rows in run 41, 20.0 in run 44) against the
# wgmma kernel; workload a AWQ against bf16. Parts that would not finish within LIMIT seconds (560 by default) are skipped.
# Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_cuda_launch.py -rf --maxfail=10 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $OUT/tests.log
tail -4 $OUT/tests.log
# persist,sc_ring[,stages]: without sc_ring where its tests failed (a fault ends the process)
V="0,0 0,1 0,1,3 0,1,4 2,1 2,1,3 3,1"
grep -q "FAILED.*scales_through" $OUT/tests.log && V="0,0 0,0,3 0,0,4 2,0 3,0" && sed -i \
  's/product(shapes, (0, 1))/product(shapes, (0,))/' $B/w4a16_skinny_bench.py  # sweep too
left 60 "steps at 1-16 rows" && timeout 150 python $B/w4a16_skinny_bench.py --step \
  --m 1 4 8 16 --gemv-variants $V --reps 5 --out $OUT/variants.json \
  > $OUT/variants.log 2>&1; tail -6 $OUT/variants.log
left 60 step && timeout 70 python $B/w4a16_skinny_bench.py --step \
  --m 33 48 64 128 192 256 512 --reps 5 > $OUT/step.log 2>&1; tail -8 $OUT/step.log
# Single-stream AWQ decode end to end: the rule as it is, then the variant fastest at 1 row.
best=$(python -c "import json,re,sys; r=json.load(open(sys.argv[1]))['steps'][0]; \
v={k: sum(t) for k, t in r.items() if k[0] == 'p'}; k=min(v, key=v.get); \
print(','.join(re.findall(r'\d+', k)))" $OUT/variants.json 2>/dev/null)
[ "$best" = 0,0,2 ] && best=""
set_rule() {  # persist sc_ring stages
  sed -i -e "s/^GEMV_PERSIST = [0-9]*/GEMV_PERSIST = $1/" \
    -e "s/^GEMV_SC_RING = [0-9]*/GEMV_SC_RING = $2/" \
    -e "s/^GEMV_STAGES = [0-9]*/GEMV_STAGES = $3/" pagoda/kernels/w4a16.py
}
for v in 0,0,2 $best; do
  left 90 "e2e b $v" || continue
  set_rule ${v//,/ }
  OUT=/tmp/b_$v timeout 80 python $B/h200_bench.py --only b --quantization awq > $OUT/b_$v.log 2>&1
  echo "b persist,sc_ring,stages=$v: $(grep -E '^b Pagoda decode tok/s' $OUT/b_$v.log)"
done
set_rule 0 0 2
left 200 "wgmma tests" && timeout 150 python -m pytest -q -m gpu \
  tests/kernels/test_w4a16_wgmma.py -rf --maxfail=10 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-300 > $OUT/tests_wgmma.log; tail -3 $OUT/tests_wgmma.log
left 100 persist && timeout $((LIMIT - SECONDS - 60)) python $B/w4a16_skinny_bench.py \
  --m 1 4 8 16 --no-sweep --no-wgmma-sweep --gemv-persist --reps 10 --out $OUT/persist.json \
  > $OUT/persist.log 2>&1
[ -s $OUT/persist.json ] && python $B/w4a16_skinny_bench.py --top 4 --family cuda \
  --out $OUT/persist.json
left 60 qkv && timeout 60 python $B/w4a16_skinny_bench.py --m 24 32 --shapes qkv \
  --no-cuda-sweep --reps 5 --out $OUT/qkv32.json > $OUT/qkv32.log 2>&1
for f in skinny wgmma; do
  [ -s $OUT/qkv32.json ] && python $B/w4a16_skinny_bench.py --top 3 --family $f --out $OUT/qkv32.json
done
for q in awq none; do
  left 100 "workload a $q" || continue
  args=(--only a); [ $q = awq ] && args+=(--quantization awq)
  OUT=/tmp/a_$q timeout 95 python $B/h200_bench.py "${args[@]}" --time-budget 85 > $OUT/a_$q.log 2>&1
  cp /tmp/a_$q/h200_bench.json $OUT/a_$q.json 2>/dev/null
  echo "$q: $(grep -E '^a Pagoda output' $OUT/a_$q.log | head -1)"
done
echo "done in $SECONDS s"
