#!/usr/bin/env bash
# Seventh session's first H200 run (its verify failed on stock's side and the
# machine was then lost; -s12-* in benchmarks/h200/results, BENCHMARKS.md): verify dequantized_experts (in the background, while
# stock's cold first chunk compiles), then the 45-layer prefill with it: at 4k
# stock, dequantized_experts alone (the exact path), the numerics-changing prefill
# set P and P + dequantized_experts; at 16k and 32k P and P + dequantized_experts
# (stock there is in -s11); then one KDA and one DSA layer at 4k. Each arm is
# timed once after a check on the first 2,048 tokens.
# Start it detached (setsid) and collect /root/res in later calls: about 1,000 s,
# of which stock's first cold chunk is about 320 s.
# Same setup as h200-session.sh. Usage: h200-s12.sh BUDGET_SECONDS
BUDGET=${1:-1300}
. "$(dirname "$0")/stages.sh"
GLM53_PATCHES_STATE_DIR=$ROOT/state-verify par verify_dequantized_experts 400 \
  $PY -m glm53_patches.cli verify dequantized_experts
export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1 MLX_PTX_CACHE_DIR=$ROOT/ptx-prefill
P=dsa_decode+kda_prefill_kernel+latent_prefill
C="--prefill-check-tokens 2048 --prefill-rounds 1 --no-png"
stage prefill_4k 700 $B --experts 64 --sections prefill --prefill 4096 $C \
  --arms stock,dequantized_experts,$P,$P+dequantized_experts --out $RES/prefill_4k.json
wait
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null
stage prefill_long 500 $B --experts 64 --sections prefill --prefill 16384,32768 $C \
  --arms $P,$P+dequantized_experts --out $RES/prefill_long.json
# One layer of each kind: what is left of a chunk once the experts are dequantized.
stage prefill_layers 200 $B --layers 5 --experts 64 --sections prefill_kda,prefill_dsa --prefill 4096 $C \
  --arms stock,kda_prefill_kernel+latent_prefill,kda_prefill_kernel+latent_prefill+dequantized_experts \
  --out $RES/prefill_layers.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
