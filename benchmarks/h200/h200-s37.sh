#!/usr/bin/env bash
# s37's device plan for routed_experts' side-by-side kernel (then on branch routed-experts-side, merged after it passed).
# One foreground call per part on a warm machine; the caller tars /root/res to $OUT.
# Part v: `verify routed_experts` (more than 310 s cold on a slow machine in s37, 112 s warm; layer_decode's code digest does not move
#   with the kernel, so its s36 record stands).
# Part p: probe_expert_mma.py (the kernel's settings against gather_qmm, bit for bit and timed), then
#   probe_expert_loads.py (the kernel beside its loads alone).
# Part b: decode at 256 and 4,096 tokens and verify blocks of 1, 3 and 4 at 4,096, D vs D + routed_experts
#   (block_qmv in both), kernels forced on: to compare with s36's main kernel (-3.5 to -3.9 ms a step).
# Usage: h200-s37.sh PART BUDGET
PART=${1:-v}
BUDGET=${2:-560}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = v ]; then
  VERIFY_LIMIT=$(( $(left) - 20 )) verify_all routed_experts
elif [ "$PART" = p ]; then
  stage probe $(( $(left) / 2 )) $PY "$(dirname "$0")/probe_expert_mma.py" --out $RES/probe_expert_mma.json
  stage loads $(( $(left) - 10 )) $PY "$(dirname "$0")/probe_expert_loads.py" --out $RES/probe_expert_loads.json
else
  export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
    GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1 GLM53_BLOCK_QMV_KERNEL=1 GLM53_ROUTED_EXPERTS_KERNEL=1
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv
  stage decode $(( $(left) - 10 )) $B --layers 45 --experts 64 --sections decode,verify --contexts 256,4096 \
    --verify-blocks 1,3,4 --prefill '' --arms stock,$D,$D+routed_experts --rounds 5 --steps 24 --warmup 4 \
    --check-steps 4 --pipelined-steps 24 --budget-s $(( $(left) - 30 )) --no-png --out $RES/decode.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
