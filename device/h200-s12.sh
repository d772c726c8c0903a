#!/usr/bin/env bash
# For the next H200 session (written in the sixth, not yet run): verify
# dequantized_experts, then prefill with it: the 45-layer model at 4k and 16k
# (stock, the numerics-changing prefill set P, P + dequantized_experts), the
# exact path at 4k (stock vs dequantized_experts alone), and one KDA and one DSA
# layer. Each arm is timed once after a check on the first 2,048 tokens.
# Start it detached (setsid) and collect /root/res in later calls: it needs
# about 1,600 s, of which stock's first cold chunk is about 320 s.
# Same setup as h200-session.sh. Usage: h200-s12.sh BUDGET_SECONDS
BUDGET=${1:-1600}
. "$(dirname "$0")/stages.sh"
GLM53_PATCHES_STATE_DIR=$ROOT/state-verify par verify_dequantized_experts 300 \
  $PY -m glm53_patches.cli verify dequantized_experts
par micro_dequant 200 $PY "$(dirname "$0")/micro_dequant.py"
wait
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null
export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1 MLX_PTX_CACHE_DIR=$ROOT/ptx-prefill
P=dsa_decode+kda_prefill_kernel+latent_prefill
C="--prefill-check-tokens 2048 --prefill-rounds 1 --no-png"
stage prefill_model 900 $B --experts 64 --sections prefill --prefill 4096,16384 $C \
  --arms stock,$P,$P+dequantized_experts --out $RES/prefill_model.json
stage prefill_exact 250 $B --experts 64 --sections prefill --prefill 4096 $C \
  --arms stock,dequantized_experts --out $RES/prefill_exact.json
# One layer of each kind: what is left of a chunk once the experts are dequantized.
stage prefill_layers 200 $B --layers 5 --experts 64 --sections prefill_kda,prefill_dsa --prefill 4096,16384 $C \
  --arms stock,kda_prefill_kernel+latent_prefill,kda_prefill_kernel+latent_prefill+dequantized_experts \
  --out $RES/prefill_layers.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
