#!/bin/bash
# The W8A8 / FP8 sweep at 128-512 rows with the TMA configs
# (`_w8a8_tma_kernel`, `..._tma[_persistent]`) among the candidates: does the copy engine's
# product beat the per-thread loads (int8) or cuBLASLt (fp8) where 1.6x is not met?
# Writes $OUT/run62b.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run62b && mkdir -p $O
trap 'tar czf $OUT/run62b.tgz -C /tmp run62b' EXIT
timeout 540 python benchmarks/w8a8_bench.py --sweep --m 128,256,512 --budget-s 200 \
  --out $O/sweep.json 2>&1 | grep -v Warn > $O/sweep.log
grep -E "per step|^ +(128|256|512) \|" $O/sweep.log | tail -12
echo "done in $SECONDS s"
