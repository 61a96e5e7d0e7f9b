#!/bin/bash
# Where an FP8 single-stream decode step goes with PAGODA_W8A8_FUSED_QUANT on and off
# (`decode_step_profile.py`: kernel counts and times, the step's wall time).
# Writes $OUT/run60b.tgz.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/run60b && mkdir -p $O
trap 'tar czf $OUT/run60b.tgz -C /tmp run60b' EXIT
for fq in 1 0; do
  PAGODA_W8A8_FUSED_QUANT=$fq timeout 90 python benchmarks/decode_step_profile.py \
    --quantization fp8 --out $O/profile_fq$fq.json > $O/profile_fq$fq.log 2>&1
  grep -v "INFO\|arn" $O/profile_fq$fq.log | head -14
done
echo "done in $SECONDS s"
