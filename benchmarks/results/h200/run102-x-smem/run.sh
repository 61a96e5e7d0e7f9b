#!/bin/bash
# Two GEMM changes not yet run on a GPU, in one call:
# - the W4A16 GEMV with x's rows in shared memory (`GemvConfig.x_smem`, 5-17% fewer instructions
#   a K step): its GPU tests (bit for bit against x from global memory, graphs, PDL chains, the
#   fused SiLU-and-mul; and the GEMV's B columns past M repeating row M - 1 instead of zeros,
#   against the dequantized reference at 1-64 rows in every launch shape), then whole steps at 1-8 rows with the rule's configs and x_smem=1 (in
#   turn, twice), then single-stream AWQ decode with PAGODA_W4A16_X_SMEM=1 and =0;
# - the W4A16 wgmma kernel's K splits summed in a cluster (`PAGODA_W4A16_CLUSTER_SPLIT`): its
#   GPU tests, then whole steps at 48-256 rows with the flag 1 and 0.
# Parts that would not finish within LIMIT seconds are skipped. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-575}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt)
echo "$gpu"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_w4a16_wgmma.py -k "x_in_shared or graph or pdl_chain or silu_and_mul_in \
  or matches_dequantized or every_launch or cluster or split_k_sums" -rf 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-400 | tee $OUT/tests.log
grep -q -E "FAILED|rror" $OUT/tests.log && echo "tests failed: timings may be wrong"
left 100 "x_smem steps" && timeout 100 python $B/w4a16_skinny_bench.py --step --m 1 2 4 8 \
  --reps 5 --gemv-variants rule x_smem=1 --out $OUT/step_x_smem.json > $OUT/step_x_smem.log 2>&1
tail -6 $OUT/step_x_smem.log
for s in 1 0; do
  left 70 "steps cluster=$s" || continue
  PAGODA_W4A16_CLUSTER_SPLIT=$s timeout 65 python $B/w4a16_skinny_bench.py --step \
    --m 48 64 128 256 --reps 10 --out $OUT/step_cluster$s.json > $OUT/step_cluster$s.log 2>&1
  echo "cluster=$s:"; tail -5 $OUT/step_cluster$s.log
done
for s in 1 0; do
  left 60 "b awq x_smem=$s" || continue
  PAGODA_W4A16_X_SMEM=$s OUT=/tmp/b timeout 75 python $B/h200_bench.py --only b \
    --quantization awq > $OUT/b_awq_x_smem$s.log 2>&1
  echo "b awq x_smem=$s: $(grep -E '^b Pagoda decode tok/s' $OUT/b_awq_x_smem$s.log | tr -s ' ')"
done
echo "done in $SECONDS s"
