#!/usr/bin/env bash
# Session 35's second machine: what the routed experts cost per decode call and per verify block
# (micro_routed_experts.py), then 3-token verify blocks at 4,096 tokens of context (the issue's "3
# accepted a round"; s35's first run timed blocks of 1, 2 and 4) with L = 1 again for the ratio, the
# same arms and forced kernels as h200-s34.sh b. One foreground call on a fresh machine: the caller
# tars /root/res to $OUT. Usage: h200-s35.sh BUDGET
BUDGET=${1:-560}
. "$(dirname "$0")/stages.sh"
stage micro_routed_experts 150 $PY "$(dirname "$0")/micro_routed_experts.py" --blocks 2,3,4 \
  --out $RES/micro_routed_experts.json
export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
  GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1 GLM53_BLOCK_QMV_KERNEL=1
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode
stage verify_blocks $(( $(left) - 10 )) $B --layers 45 --experts 64 --sections verify --contexts 4096 \
  --prefill '' --verify-blocks ${BLOCKS:-1,3} --arms stock,$D,$D+block_qmv --rounds 3 --steps 4 --warmup 1 \
  --check-steps 1 --budget-s $(( $(left) - 30 )) --no-png --out $RES/verify_blocks.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
