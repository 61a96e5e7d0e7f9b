#!/bin/bash
# The GEMV rule (tuned on the H100) on an H200: the CUDA configs swept at 1-16 rows against
# `gemv_config`'s, and whole steps twice (PDL on and off). Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python $B/w4a16_skinny_bench.py --m 1 2 4 8 12 16 --no-sweep --no-wgmma-sweep \
  --reps 10 --out $OUT/sweep.json > $OUT/sweep.log 2>&1
grep -A9 "ms per decode step" $OUT/sweep.log
python - $OUT/sweep.json <<'PY'
import collections, json, sys
g = collections.defaultdict(list)
for r in json.load(open(sys.argv[1]))["rows"]:
    g[(r["shape"], r["m"])].append(r)
for key, rows in sorted(g.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    c = sorted((r for r in rows if r["variant"] == "cuda"), key=lambda r: r["us"])
    ref = {r["variant"]: round(r["us"], 1) for r in rows if r["variant"] in ("default", "cublas_bf16")}
    print(*key, ref, [(round(r["us"], 1), r["config"]) for r in c[:3]])
PY
timeout 60 python $(dirname "$0")/host.py > $OUT/host.log 2>&1; cat $OUT/host.log | tail -22
for i in 1 2; do
  timeout 60 python $B/w4a16_skinny_bench.py --step --m 1 2 4 8 12 16 --reps 10 > $OUT/step$i.log 2>&1
  tail -7 $OUT/step$i.log | cut -c1-50
done
echo "done in $SECONDS s"
