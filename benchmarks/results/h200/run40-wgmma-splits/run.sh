#!/bin/bash
# Not yet run. The rule of b85aced (tiles of 160 and 192 rows) timed as whole steps and in
# workload a; the sweep with 224-row tiles and the rule's configs with K split 1-6 ways (grids
# of 1.5-3 waves). Writes to $OUT; LIMIT seconds in all.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-560}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py -rf > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log | cut -c1-300
timeout 90 python -m pytest -q -m gpu tests/kernels/test_w4a16.py tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_skinny_gemm.py -k graph -rf > $OUT/tests_graph.log 2>&1  # the shared helper
tail -3 $OUT/tests_graph.log | cut -c1-300
timeout 60 python $B/w4a16_skinny_bench.py --step --m 96 128 160 192 224 256 --reps 5 \
  > $OUT/step.log 2>&1
tail -7 $OUT/step.log
timeout 150 python $B/w4a16_skinny_bench.py --m 128 160 192 224 256 512 --no-sweep \
  --no-cuda-sweep --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -8 $OUT/sweep.log
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
for q in awq none; do
  [ $((LIMIT - SECONDS)) -gt 100 ] || { echo "skipped (time): workload a $q"; continue; }
  args=(--only a); [ $q = awq ] && args+=(--quantization awq)
  half=1; [ $q = awq ] && half=2
  t=$(((LIMIT - SECONDS) / half - 10))
  OUT=/tmp/a_$q timeout $((t + 5)) python $B/h200_bench.py "${args[@]}" --time-budget $t \
    > $OUT/a_$q.log 2>&1
  cp /tmp/a_$q/h200_bench.json $OUT/a_$q.json 2>/dev/null
  echo "$q: $(grep -E '^a Pagoda output' $OUT/a_$q.log | head -1)"
done
echo "done in $SECONDS s"
