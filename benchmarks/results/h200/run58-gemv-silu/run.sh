#!/bin/bash
# SiLU-and-mul in the 4-bit gate_up GEMV's epilogue
# (`w4a16_silu_and_mul`: a CTA takes 16 gate rows and the same 16 up rows; LlamaMLP asks the
# layer's method for it first; PAGODA_W4A16_SILU=1 turns it on): the GEMV's GPU tests, then
# single-stream AWQ decode and the decode step's kernels (`decode_step_profile.py`, without
# PDL: each kernel's own time), each with PAGODA_W4A16_SILU 0 and 1 in turn.
# Writes $OUT/run58.tgz (the device returns few files).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run58 && mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 170 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py -rf --maxfail=10 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-300 > $O/tests.log
tail -4 $O/tests.log
grep -q "FAILED" $O/tests.log && { tar czf $OUT/run58.tgz -C /tmp run58; exit 1; }
for silu in 0 1 0 1; do
  PAGODA_W4A16_SILU=$silu OUT=/tmp/b timeout 80 python benchmarks/h200_bench.py --only b \
    --quantization awq > $O/b_silu$silu.log 2>&1
  echo "silu $silu: $(grep -E '^b Pagoda decode tok/s' $O/b_silu$silu.log)"
done
for silu in 0 1; do
  PAGODA_W4A16_SILU=$silu PAGODA_PDL=0 timeout 60 python benchmarks/decode_step_profile.py \
    --quantization awq --out $O/profile_silu$silu.json > $O/profile_silu$silu.log 2>&1
  grep -v "INFO\|arn" $O/profile_silu$silu.log | head -12
done
tar czf $OUT/run58.tgz -C /tmp run58
echo "done in $SECONDS s"
