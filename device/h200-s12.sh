#!/usr/bin/env bash
# For the next H200 session (written in the sixth, not yet run): verify
# dequantized_experts; prefill of one KDA and one DSA layer, then of the 45-layer
# model at 4k and 16k, stock vs the prefill patches with and without it (each
# arm timed once after a check on the first 2,048 tokens; the check's seconds
# are each arm's first-use stall).
# Same setup as h200-session.sh. Usage: h200-s12.sh BUDGET_SECONDS
BUDGET=${1:-1500}
. "$(dirname "$0")/stages.sh"
GLM53_PATCHES_STATE_DIR=$ROOT/state-verify par verify_dequantized_experts 300 \
  $PY -m glm53_patches.cli verify dequantized_experts
par micro_dequant 200 $PY "$(dirname "$0")/micro_dequant.py"
wait
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null
export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1 MLX_PTX_CACHE_DIR=$ROOT/ptx-prefill
P=dsa_decode+kda_prefill_kernel+latent_prefill
# One layer of each kind: what is left of a chunk once the experts are dequantized.
stage prefill_layers 200 $B --layers 5 --experts 64 --sections prefill_kda,prefill_dsa --prefill 4096,16384 \
  --prefill-check-tokens 2048 --prefill-rounds 1 --no-png --out $RES/prefill_layers.json \
  --arms stock,kda_prefill_kernel+latent_prefill,kda_prefill_kernel+latent_prefill+dequantized_experts
stage prefill_model 1100 $B --experts 64 --sections prefill --prefill 4096,16384 --prefill-check-tokens 2048 \
  --prefill-rounds 1 --arms stock,$P,$P+dequantized_experts,dequantized_experts --no-png --out $RES/prefill_model.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
