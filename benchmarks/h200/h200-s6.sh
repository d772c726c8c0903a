#!/usr/bin/env bash
# Fourth session's H200 runs: the new router_select and expert_combine kernels
# (verify, then the 45-layer step with them), the verify records for the other
# kernel patches, and the measurements issues 5 and 6 still miss. Same setup as
# h200-session.sh. Usage: h200-s6.sh BUDGET_SECONDS
BUDGET=${1:-1600}
. "$(dirname "$0")/stages.sh"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; python3 --version; } > $RES/machine.txt 2>&1

# 1. Untimed, in parallel: verify (each patch in its own process and state
#    folder, so one slow compile starves nothing and no record is lost), and a
#    warm-up of the timed step's kernels.
verify() { GLM53_PATCHES_STATE_DIR=$ROOT/state-$1 par verify_$1 $2 $PY -m glm53_patches.cli verify $1; }
verify router_select 300
verify expert_combine 300
verify hc_decode 330
verify compiled_kda_decode 330
verify dsa_decode 330
export GLM53_HC_DECODE_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 GLM53_EXPERT_COMBINE_KERNEL=1
BEST=compiled_kda_decode+dsa_decode+hc_decode
ARMS=stock,$BEST,$BEST+router_select,$BEST+router_select+expert_combine
par warm_step 330 $B --experts 8 --sections decode --contexts 256 $W --budget-s 300 --arms $ARMS \
  --out $ROOT/warm/step.json
wait
merge_ptx
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null

# 2. Timed, one at a time (the kernels forced on: each arm's own check says
#    whether it stayed bit-identical to stock).
stage step 330 $B --experts 64 --sections decode,graph --contexts 256,4096 --arms $ARMS \
  --rounds 3 --steps 16 --warmup 3 --check-steps 4 --budget-s 300 --no-png --out $RES/step.json
stage vault_ttft 380 $PY -m glm53_patches.patches.vault_cache.checks.ttft $( [ -n "$EXTRA" ] && echo --small ) \
  --patches kda_prefill_kernel,latent_prefill $( [ -z "$EXTRA" ] && echo --prompts 16384 ) --budget-s 360 \
  --dir $ROOT/ttft --out $RES/vault_ttft.json
pkill -f vault_cache.ttft; cp $ROOT/ttft/result-*.json $RES/ 2>/dev/null
stage prefill_model 300 $B --experts 64 --sections prefill --prefill 4096 --prefill-rounds 1 \
  --arms stock,dsa_decode+kda_prefill_kernel+latent_prefill --budget-s 280 --no-png --out $RES/prefill_model.json
stage prefill_dsa_32k 150 $B --layers 5 --experts 64 --sections prefill_dsa --prefill 32768 \
  --prefill-rounds 1 --arms stock,latent_prefill --budget-s 130 --no-png --out $RES/prefill_dsa_32k.json
stage moe 120 $B --layers 5 --experts 64 --sections moe --arms stock,router_select,router_select+expert_combine \
  --rounds 3 --budget-s 100 --no-png --out $RES/moe.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
