#!/usr/bin/env bash
# Seventh session's second H200 run (the first lost its machine while verify
# failed; see BENCHMARKS.md): the 45-layer prefill with dequantized_experts at
# 4k, 16k and 32k, the numerics-changing prefill set P vs P + dequantized_experts
# (stock at these lengths: -s6, -s11), each arm timed once after a check on the
# first 2,048 tokens; then verify's projection check at real widths on its own.
# Stock is always the reference arm: with its cold check (about 300 s) the
# stage ended inside 16k's stock arm, and the projection check never ran.
# Same setup as h200-session.sh. Usage: h200-s13.sh BUDGET_SECONDS
BUDGET=${1:-700}
. "$(dirname "$0")/stages.sh"
export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1 MLX_PTX_CACHE_DIR=$ROOT/ptx-prefill
P=dsa_decode+kda_prefill_kernel+latent_prefill
stage prefill_model 560 $B --experts 64 --sections prefill --prefill 4096,16384,32768 \
  --prefill-check-tokens 2048 --prefill-rounds 1 --no-png \
  --arms $P,$P+dequantized_experts --out $RES/prefill_model.json
stage verify_projections 150 $PY -c "
from glm53_patches.exactness import Tally
from glm53_patches.patches.dequantized_experts.checks.verify import check_projections
t = Tally(); check_projections(t, True); print(t.result(0.0))"
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
