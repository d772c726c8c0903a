#!/usr/bin/env bash
# Eleventh session, second run: CUDA verify of exact_kda_prefill on the final code (its
# own kernel cache), beside `warmup_first_request.py` (a 4-layer checkpoint at real
# widths: `glm53-patches warmup`, then the stock server's first request on that cache).
# Start it detached (setsid) and collect /root/res in later calls. Usage: h200-s18.sh BUDGET
BUDGET=${1:-520}
. "$(dirname "$0")/stages.sh"
GLM53_PATCHES_STATE_DIR=$ROOT/state-exact_kda_prefill par verify_exact_kda_prefill 480 \
  $PY -m glm53_patches.cli verify exact_kda_prefill --report $RES/verify_exact_kda_prefill.json
stage warmup_first_request 480 $PY "$(dirname "$0")/warmup_first_request.py" --out $RES/warmup_first_request.json
wait
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
