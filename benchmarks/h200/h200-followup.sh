#!/usr/bin/env bash
# The second H200 session of 2026-11-30: what the first one (h200-session.sh)
# left open. Same setup and usage: h200-followup.sh BUDGET_SECONDS
BUDGET=${1:-600}
. "$(dirname "$0")/stages.sh"
export GLM53_HC_DECODE_KERNEL=1  # hc_decode's CUDA kernel on, also before `verify hc_decode` has passed

W="$W --budget-s 220"
par verify 230 $PY -m glm53_patches.cli verify compiled_kda_decode hc_decode
par indexer_quality 230 $PY -m glm53_patches.patches.indexer_fp32.checks.quality --kernel
par warm_step 230 $B --experts 8 --sections decode --contexts 256 $W --arms stock,hc_decode --out $ROOT/warm/step.json
par warm_dsa 230 $B --layers 5 --experts 8 --sections prefill_dsa --prefill 2048 $W --arms stock,latent_prefill \
  --out $ROOT/warm/dsa.json
wait
merge_ptx

stage step 170 $B --experts 64 --sections decode,graph --contexts 256,4096 \
  --arms stock,hc_decode,compiled_kda_decode+dsa_decode+hc_decode --rounds 2 --steps 12 --warmup 2 \
  --check-steps 3 --budget-s 150 --no-png --out $RES/step_hc.json
stage prefill_dsa 120 $B --layers 5 --experts 64 --sections prefill_dsa --prefill 4096,16384 \
  --prefill-rounds 1 --arms stock,latent_prefill --budget-s 100 --no-png --out $RES/prefill_dsa_latent.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
