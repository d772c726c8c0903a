#!/usr/bin/env bash
# The H200 runs still missing after 2026-11-30 (issues 5, 6 and 8), for the next
# session with device time. Same setup as h200-session.sh (copy the device/
# folder, start detached, collect /root/res). Usage: h200-next.sh BUDGET_SECONDS
BUDGET=${1:-1400}
. "$(dirname "$0")/stages.sh"

# 1. Untimed, in parallel: the verify records `GLM53_PATCHES=all` needs on CUDA
#    (each patch in its own process, so one slow compile does not starve the rest),
#    and warm-ups for the timed runs.
W="$W --budget-s 380"
par verify_hc 400 $PY -m glm53_patches.cli verify hc_decode
par verify_kda 400 $PY -m glm53_patches.cli verify compiled_kda_decode
par verify_dsa 400 $PY -m glm53_patches.cli verify dsa_decode
par warm_step 400 $B --experts 8 --sections decode --contexts 256 $W --arms stock,all --out $ROOT/warm/step.json
par warm_prefill 400 $B --experts 8 --sections prefill --prefill 2048 $W \
  --arms stock,all+kda_prefill_kernel+latent_prefill --out $ROOT/warm/prefill.json
wait
merge_ptx
$PY -m glm53_patches.cli status > $RES/status.txt 2>&1

# 2. Timed. `all` now includes hc_decode's kernel where its verify passed.
stage step 200 $B --experts 64 --sections decode,graph --contexts 256,4096 --arms stock,all \
  --rounds 3 --steps 16 --warmup 3 --check-steps 4 --budget-s 180 --no-png --out $RES/step_all.json
stage prefill_dsa_32k 150 $B --layers 5 --experts 64 --sections prefill_dsa --prefill 32768 \
  --prefill-rounds 1 --arms stock,latent_prefill --budget-s 130 --no-png --out $RES/prefill_dsa_32k.json
stage vault_ttft 420 $PY -m glm53_patches.patches.vault_cache.ttft $( [ -n "$EXTRA" ] && echo --small ) \
  --patches kda_prefill_kernel,latent_prefill --prompts 4096,16384 --budget-s 400 --dir $ROOT/ttft \
  --out $RES/vault_ttft.json
pkill -f vault_cache.ttft; cp $ROOT/ttft/result-*.json $RES/ 2>/dev/null
stage prefill_model 300 $B --experts 64 --sections prefill --prefill 4096 --prefill-rounds 1 \
  --arms stock,all+kda_prefill_kernel+latent_prefill --budget-s 280 --no-png --out $RES/prefill_model.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
