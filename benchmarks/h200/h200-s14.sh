#!/usr/bin/env bash
# For the next H200 session (written in the seventh, not yet run): verify
# dequantized_experts with its widened GPU tiny model (in the background, while
# stock's cold check compiles); the 45-layer prefill at 16k and 32k, P vs
# P + dequantized_experts with stock untimed (its figures there: -s11); then where
# one chunk of a KDA and of a DSA layer goes with P + dequantized_experts, at 4k
# and 32k of context. P = dsa_decode+kda_prefill_kernel+latent_prefill.
# Start it detached (setsid) and collect /root/res in later calls: about 850 s.
# Same setup as h200-session.sh. Usage: h200-s14.sh BUDGET_SECONDS
BUDGET=${1:-1200}
. "$(dirname "$0")/stages.sh"
GLM53_PATCHES_STATE_DIR=$ROOT/state-verify par verify_dequantized_experts 400 \
  $PY -m glm53_patches.cli verify dequantized_experts
export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1 MLX_PTX_CACHE_DIR=$ROOT/ptx-prefill
P=dsa_decode+kda_prefill_kernel+latent_prefill
stage prefill_long 750 $B --experts 64 --sections prefill --prefill 16384,32768 --prefill-check-tokens 2048 \
  --prefill-rounds 1 --prefill-untimed-stock --no-png --arms $P,$P+dequantized_experts --out $RES/prefill_long.json
wait
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null
for ctx in 4096 32768; do
  stage profile_$ctx 150 $PY "$(dirname "$0")/profile_prefill_chunk.py" ${PROFILE_EXTRA:-} --context $ctx \
    --patches ${P//+/,},dequantized_experts --out $RES/profile_$ctx.json
done
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
