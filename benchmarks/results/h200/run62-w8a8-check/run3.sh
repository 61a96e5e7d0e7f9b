#!/bin/bash
# Workload a and single-stream decode with FP8 and INT8 weights and an FP8 KV cache, the
# quantization in RMSNorm / SiLU-and-mul and the GEMM under PDL. Writes $OUT/run62c.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run62c && mkdir -p $O
trap 'tar czf $OUT/run62c.tgz -C /tmp run62c' EXIT
for q in fp8 w8a8; do
  OUT=/tmp/a timeout 140 python benchmarks/h200_bench.py --only a,b --quantization $q \
    --kv-cache-dtypes fp8 > $O/ab_$q.log 2>&1
  echo "$q: $(grep -E '^(a Pagoda output|b Pagoda decode) tok/s' $O/ab_$q.log | tr -s ' ')"
done
echo "done in $SECONDS s"
