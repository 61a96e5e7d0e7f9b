#!/bin/bash
# The wgmma kernel's stage release by a relaxed atomic against the acq_rel one (a MEMBAR.ALL.CTA
# in SASS) in whole steps, A/B in one call (PAGODA_AB_ACQREL=1: the old release); then the
# sweep at 32-1024 rows with the relaxed release. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py tests/kernels/test_cuda_launch.py \
  -rf > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log | cut -c1-300
for ab in 1 0 1 0; do
  echo "== acq_rel=$ab"
  PAGODA_AB_ACQREL=$ab timeout 60 python $B/w4a16_skinny_bench.py --step --m 32 64 128 192 256 512 1024 \
    --reps 5 > $OUT/step_$ab.log 2>&1
  grep -A8 "wgmma 64" $OUT/step_$ab.log | head -9
done
timeout 240 python $B/w4a16_skinny_bench.py --m 32 64 128 256 512 --no-sweep --no-cuda-sweep --reps 5 \
  --out $OUT/sweep.json > $OUT/sweep.log 2>&1; grep -E "failed|per step|step" $OUT/sweep.log | head -20
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
