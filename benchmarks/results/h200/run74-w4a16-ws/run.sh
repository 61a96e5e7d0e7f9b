#!/bin/bash
# The warp-specialized W4A16 kernel (`w4a16_ws.cu`) on its first GPU: its GPU tests, then a
# sweep of its configs (`ws_grid`) against the rule and bf16 cuBLAS at 64-256 rows.
# Writes $OUT/run74.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-540}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
O=/tmp/run74 && mkdir -p $O
trap 'tar czf $OUT/run74.tgz -C /tmp run74' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 150 python -m pytest -q -x -m gpu tests/kernels/test_w4a16_ws.py -p no:cacheprovider \
  > $O/tests.log 2>&1
echo "tests rc=$?"; tail -25 $O/tests.log | grep -v "^ *$" | cut -c1-400
for m in 256 128 192 64; do
  left 60 "sweep $m" || continue
  timeout $((LIMIT - SECONDS - 20)) python $B/w4a16_skinny_bench.py --m $m --no-sweep \
    --no-cuda-sweep --no-wgmma-sweep --reps 10 --out $O/sweep_$m.json > $O/sweep_$m.log 2>&1
  grep -E "WRONG|Error|M= *$m " $O/sweep_$m.log | cut -c1-600 | head -12
  python $B/w4a16_skinny_bench.py --top 4 --family ws --out $O/sweep_$m.json 2>&1 | cut -c1-400
done
echo "done in $SECONDS s"
