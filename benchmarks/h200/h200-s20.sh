#!/usr/bin/env bash
# Twelfth session, second run (the first machine went back before the bench ended): why the
# stock server refused warmup's first request on the H200 (probe_server_budget, tiny model);
# the 45-layer 4k prefill, stock vs E = exact_kda_prefill + dequantized_experts vs
# E + exact_sparse_prefill (2 interleaved rounds after the check pass: every arm bit for bit
# against stock on the first 2,048 tokens; fast paths forced on by their knobs); then
# warmup_first_request. Start it detached (setsid) and collect /root/res. Usage: h200-s20.sh BUDGET
BUDGET=${1:-1000}
. "$(dirname "$0")/stages.sh"
stage server_budget 200 $PY "$(dirname "$0")/probe_server_budget.py"
export GLM53_EXACT_KDA_PREFILL_KERNEL=1 GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1 GLM53_EXACT_SPARSE_PREFILL_KERNEL=1
E=exact_kda_prefill+dequantized_experts
( export MLX_PTX_CACHE_DIR=$ROOT/ptx-bench
  stage prefill_model 700 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
    --prefill-rounds 2 --no-png --arms stock,$E,$E+exact_sparse_prefill --out $RES/prefill_model.json )
unset GLM53_EXACT_KDA_PREFILL_KERNEL GLM53_DEQUANTIZED_EXPERTS_FAST_PATH GLM53_EXACT_SPARSE_PREFILL_KERNEL
stage warmup_first_request 500 $PY "$(dirname "$0")/warmup_first_request.py" --out $RES/warmup_first_request.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
