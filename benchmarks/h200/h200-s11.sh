#!/usr/bin/env bash
# Sixth session's H200 run: re-verify on the current code the four kernel patches
# whose record digests moved (kernels unchanged), answer whether a cuda_kernel runs
# inside mx.compile, then issue 5's 45-layer prefill at 16k and 32k, stock vs the
# prefill patches, each arm timed once after a check on the first 2,048 tokens.
# Same setup as h200-session.sh. Usage: h200-s11.sh BUDGET_SECONDS
BUDGET=${1:-1300}
. "$(dirname "$0")/stages.sh"
verify() { GLM53_PATCHES_STATE_DIR=$ROOT/state-$1 par verify_$1 $2 $PY -m glm53_patches.cli verify $1; }
for p in compiled_kda_decode router_select expert_combine fused_kda_kernel; do verify $p 280; done
par probe_conv 120 $PY "$(dirname "$0")/probe_conv.py"
wait
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null
# A fresh kernel cache: the check pass's seconds are then each arm's first-use stall.
export MLX_PTX_CACHE_DIR=$ROOT/ptx-prefill
stage prefill_model 1100 $B --experts 64 --sections prefill --prefill 16384,32768 --prefill-check-tokens 2048 \
  --prefill-rounds 1 --arms stock,dsa_decode+kda_prefill_kernel+latent_prefill --no-png --out $RES/prefill_model.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
