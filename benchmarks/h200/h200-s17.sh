#!/usr/bin/env bash
# Eleventh session (issue 18): CUDA verify of exact_kda_prefill in the background
# while one KDA layer's 4k prefill runs stock vs exact_kda_prefill vs
# kda_prefill_kernel; then the 45-layer 4k prefill, stock vs dequantized_experts
# (today's exact `all` for prefill) vs E = exact_kda_prefill + dequantized_experts,
# 2 interleaved rounds after the check pass (which compares every arm with stock,
# bit for bit, on the first 2,048 tokens); then where a chunk goes with E.
# The fast paths are forced on (their knobs) so the timed arms need no verify record.
# Start it detached (setsid) and collect /root/res in later calls.
# Usage: h200-s17.sh BUDGET_SECONDS
BUDGET=${1:-1300}
. "$(dirname "$0")/stages.sh"
GLM53_PATCHES_STATE_DIR=$ROOT/state-exact_kda_prefill par verify_exact_kda_prefill 500 $PY -m glm53_patches.cli verify exact_kda_prefill \
  --report $RES/verify_exact_kda_prefill.json
export GLM53_EXACT_KDA_PREFILL_KERNEL=1 GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1  # after verify started: it runs unforced
( export MLX_PTX_CACHE_DIR=$ROOT/ptx-layer
  stage prefill_kda 420 $B --experts 64 --sections prefill_kda --prefill 4096 --prefill-rounds 2 --no-png \
    --arms stock,exact_kda_prefill,kda_prefill_kernel --out $RES/prefill_kda.json )
wait
merge_ptx
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null
E=exact_kda_prefill+dequantized_experts
stage prefill_model 800 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
  --prefill-rounds 2 --no-png --arms stock,dequantized_experts,$E --out $RES/prefill_model.json
stage profile_4096 200 $PY "$(dirname "$0")/profile_prefill_chunk.py" ${PROFILE_EXTRA:-} --context 4096 \
  --patches exact_kda_prefill,dequantized_experts --out $RES/profile_4096.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
