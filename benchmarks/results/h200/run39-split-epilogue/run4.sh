#!/bin/bash
# x tiles by one bulk (TMA) copy a step completing on an mbarrier, stages released per warp
# (no CTA barrier a step; `x_bulk`): the wgmma GPU tests, then the sweep at 32-512 rows with
# and without it. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py -rf > $OUT/tests.log 2>&1
tail -4 $OUT/tests.log | cut -c1-300
timeout 300 python $B/w4a16_skinny_bench.py --m 32 64 128 192 256 512 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -9 $OUT/sweep.log
python - $OUT/sweep.json <<'PY'
import collections, json, sys
g = collections.defaultdict(list)
for r in json.load(open(sys.argv[1]))["rows"]:
    g[(r["shape"], r["m"])].append(r)
for key, rows in g.items():
    w = sorted((r for r in rows if r["variant"].startswith("wgmma")), key=lambda r: r["us"])
    ref = {r["variant"]: round(r["us"], 1) for r in rows if not r["variant"].startswith("wgmma")}
    best = {b: [(round(r["us"], 1), r["config"]) for r in w if r["config"][-1] == b][:2] for b in (0, 1)}
    print(*key, ref.get("cublas_bf16"), ref.get("default"), best)
PY
echo "done in $SECONDS s"
