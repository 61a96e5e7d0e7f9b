#!/bin/bash
# Not yet run. Single-stream AWQ decode end to end (`h200_bench.py --only b`) with the ring
# GEMV's rule as it is (w4a16.GEMV_PERSIST = GEMV_SC_RING = 0) and with the (persist,sc_ring)
# pairs given as arguments (default 0,1 and 2,1: scales through the ring, and that as a
# persistent grid), alternated; the constants are edited in this copy of the tree only.
# Parts that would not finish within LIMIT seconds (560 by default) are skipped. Writes to
# $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
P=("${@:-0,1 2,1}")
read -ra P <<< "${P[*]}"
i=0
variant() {  # persist, sc_ring
  sed -i -e "s/^GEMV_PERSIST = [0-9]*/GEMV_PERSIST = $1/" \
    -e "s/^GEMV_SC_RING = [0-9]*/GEMV_SC_RING = $2/" pagoda/kernels/w4a16.py
}
for v in 0,0 "${P[@]}" 0,0 "${P[@]}"; do
  i=$((i + 1))
  left 80 "e2e persist,sc_ring=$v" || continue
  variant ${v%,*} ${v#*,}
  OUT=/tmp/b$i timeout 75 python $B/h200_bench.py --only b --quantization awq \
    > $OUT/b$i-$v.log 2>&1
  echo "persist,sc_ring=$v: $(grep -E '^b Pagoda decode tok/s' $OUT/b$i-$v.log)"
done
variant 0 0
echo "done in $SECONDS s"
