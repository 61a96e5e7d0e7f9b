#!/bin/bash
# Tiles of 96, 160 and 192 activation rows (one tile for all the rows where 128-row tiles need
# two): the wgmma GPU tests, then the sweep at 96, 160 and 192 rows. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py -rf > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log | cut -c1-300
timeout 120 python $B/w4a16_skinny_bench.py --m 96 160 192 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -5 $OUT/sweep.log
python - $OUT/sweep.json <<'PY'
import collections, json, sys
g = collections.defaultdict(list)
for r in json.load(open(sys.argv[1]))["rows"]:
    g[(r["shape"], r["m"])].append(r)
for key, rows in g.items():
    w = sorted((r for r in rows if r["variant"].startswith("wgmma")), key=lambda r: r["us"])
    ref = {r["variant"]: round(r["us"], 1) for r in rows if not r["variant"].startswith("wgmma")}
    print(*key, ref.get("cublas_bf16"), ref.get("default"), [(round(r["us"], 1), r["config"]) for r in w[:3]])
PY
echo "done in $SECONDS s"
