#!/bin/bash
# The 8-bit rule with clusters at 129-192 rows (w8a8_wgmma.choose_config): its GPU tests, the
# step table, then workload a with INT8 weights (FP8 KV cache) with the rule and without its
# clusters (no_clusters/sitecustomize.py), A B in one call. Writes $OUT/run73.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
P=$B/results/h200/run73-w8a8-cluster-rule
O=/tmp/run73 && mkdir -p $O
trap 'tar czf $OUT/run73.tgz -C /tmp run73' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout -k 5 60 python -m pytest -q -m gpu tests/kernels/test_w8a8_wgmma.py 2>&1 | tail -4 \
  | tee $O/tests.log
for v in rule no_clusters; do
  pp=$([ $v = rule ] || echo $P/no_clusters)
  PYTHONPATH=$pp timeout -k 5 40 python $B/w8a8_bench.py --m 128,160,192,256 --out $O/w8a8_$v.json 2>&1 \
    | grep -v Warn > $O/w8a8_$v.log
  echo "$v"; grep -E "^ +[0-9]+ \|" $O/w8a8_$v.log | cut -c1-200
done
for i in 1; do
  for v in rule no_clusters; do
    pp=$([ $v = rule ] || echo $P/no_clusters)
    PYTHONPATH=$pp OUT=/tmp/a timeout -k 5 50 python $B/h200_bench.py --only a --quantization w8a8 \
      --kv-cache-dtypes fp8 > $O/a_${v}_$i.log 2>&1
    echo "a w8a8 $v $i: $(grep -E '^a Pagoda output tok/s' $O/a_${v}_$i.log | tr -s ' ')"
  done
done
echo "done in $SECONDS s"
