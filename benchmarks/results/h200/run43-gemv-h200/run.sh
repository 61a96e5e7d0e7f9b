#!/bin/bash
# Host time per eager W4A16 call against F.linear (`host.py`); then, with the time left, the
# GEMV rule (tuned on the H100) on this GPU: the CUDA configs swept at 1-16 rows against
# `gemv_config`'s, and whole steps. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
R=$B/results/h200/run43-gemv-h200
LIMIT=${LIMIT:-150}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python $R/host.py > $OUT/host.log 2>&1; tail -22 $OUT/host.log
left 30 step && timeout 40 python $B/w4a16_skinny_bench.py --step --m 1 2 4 8 12 16 --reps 10 \
  > $OUT/step.log 2>&1; tail -7 $OUT/step.log | cut -c1-50
left 60 sweep && timeout $((LIMIT - SECONDS)) python $B/w4a16_skinny_bench.py --m 1 4 8 16 \
  --no-sweep --no-wgmma-sweep --reps 10 --out $OUT/sweep.json > $OUT/sweep.log 2>&1
[ -s $OUT/sweep.json ] && python - $OUT/sweep.json <<'PY'
import collections, json, sys
g = collections.defaultdict(list)
for r in json.load(open(sys.argv[1]))["rows"]:
    g[(r["shape"], r["m"])].append(r)
for key, rows in sorted(g.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    c = sorted((r for r in rows if r["variant"] == "cuda"), key=lambda r: r["us"])
    ref = {r["variant"]: round(r["us"], 1) for r in rows if r["variant"] in ("default", "cublas_bf16")}
    print(*key, ref, [(round(r["us"], 1), r["config"]) for r in c[:2]])
PY
echo "done in $SECONDS s"
