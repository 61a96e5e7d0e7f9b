#!/bin/bash
# Not yet run. Single-stream AWQ decode end to end (`h200_bench.py --only b`) with the ring
# GEMV's grid as it was (w4a16.GEMV_PERSIST = 0) and persistent (the values given as
# arguments, default 2 and 3), alternated; the constant is edited in this copy of the tree
# only. Parts that would not finish within LIMIT seconds (560 by default) are skipped. Writes
# to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
P=("${@:-2 3}")
read -ra P <<< "${P[*]}"
i=0
for p in 0 "${P[@]}" 0 "${P[@]}"; do
  i=$((i + 1))
  left 80 "e2e persist=$p" || continue
  sed -i "s/^GEMV_PERSIST = [0-9]*/GEMV_PERSIST = $p/" pagoda/kernels/w4a16.py
  OUT=/tmp/b$i timeout 75 python $B/h200_bench.py --only b --quantization awq \
    > $OUT/b${i}_persist$p.log 2>&1
  echo "persist=$p: $(grep -E '^b Pagoda decode tok/s' $OUT/b${i}_persist$p.log)"
done
sed -i "s/^GEMV_PERSIST = [0-9]*/GEMV_PERSIST = 0/" pagoda/kernels/w4a16.py
echo "done in $SECONDS s"
