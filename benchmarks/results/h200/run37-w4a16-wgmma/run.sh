#!/bin/bash
# One call: the wgmma W4A16 kernel's first run (GPU tests, the structured probe where they
# fail, the sweep of its tiles against the rule and bf16 cuBLAS at 32-1024 rows, whole decode
# steps), then PDL for every kernel between the GEMMs (the engine's tokens with PDL on and off,
# the GEMV tests, single-stream AWQ decode with PDL on and off). Steps that would not finish
# within LIMIT seconds (580 by default) are skipped. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
R=$B/results/h200/run37-w4a16-wgmma
LIMIT=${LIMIT:-580}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 130 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py -rf -x 2>&1 \
  | grep -E "FAILED|passed|failed|rror|assert" | cut -c1-400 > $OUT/tests.log; tail -3 $OUT/tests.log
if grep -qE "failed|rror" $OUT/tests.log; then
  timeout 60 python $R/probe.py > $OUT/probe.log 2>&1; cut -c1-300 $OUT/probe.log | head -30
fi
left 150 sweep && timeout 140 python $B/w4a16_skinny_bench.py --m 32 64 128 256 1024 --no-sweep \
  --no-cuda-sweep --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -8 $OUT/sweep.log
left 100 pdl-tests && timeout 90 python -m pytest -q -m gpu tests/engine/test_gpu_engine.py \
  tests/kernels/test_w4a16_gemv.py -k "programmatic or pdl or bulk" -rf 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $OUT/pdl_tests.log; tail -3 $OUT/pdl_tests.log
for p in 1 0; do
  left 80 "e2e PDL=$p" || continue
  PAGODA_PDL=$p OUT=/tmp/b$p timeout 75 python $B/h200_bench.py --only b --quantization awq \
    > $OUT/b_pdl$p.log 2>&1
  echo "PDL=$p: $(grep -E '^b Pagoda decode tok/s' $OUT/b_pdl$p.log)"
done
left 50 step && timeout 60 python $B/w4a16_skinny_bench.py --step --m 1 16 64 256 --reps 5 \
  > $OUT/step.log 2>&1; tail -6 $OUT/step.log
echo "done in $SECONDS s"
