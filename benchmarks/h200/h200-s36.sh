#!/usr/bin/env bash
# The next device session's plan for routed_experts (s35: written, never run as a patch on a GPU).
# One foreground call per part on a warm machine; the caller tars /root/res to $OUT.
# Part v: `verify routed_experts` and `verify layer_decode` side by side (its COMPOSES gained
#   routed_experts, so its code digest and record moved; alone it took 256-396 s on earlier machines).
# Part p: probe_expert_mma.py: the kernel's variants (2 warps, bf16-pair dequantization, 2 and 4 tiles)
#   against gather_qmm, bit for bit and timed; pick the fastest exact one as the default.
# Part b: decode at 256 and 4,096 tokens and 4-token verify blocks, D vs D + routed_experts (with
#   block_qmv in both), kernels forced on.
# Usage: h200-s36.sh PART BUDGET
PART=${1:-v}
BUDGET=${2:-560}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = v ]; then
  VERIFY_LIMIT=$(( $(left) - 20 )) verify_all routed_experts layer_decode  # in parallel, a kernel cache each
elif [ "$PART" = p ]; then
  stage probe $(( $(left) - 10 )) $PY "$(dirname "$0")/probe_expert_mma.py" --out $RES/probe_expert_mma.json
else
  export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
    GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1 GLM53_BLOCK_QMV_KERNEL=1 GLM53_ROUTED_EXPERTS_KERNEL=1
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv
  stage decode $(( $(left) / 2 )) $B --layers 45 --experts 64 --sections decode --contexts 256,4096 \
    --prefill '' --arms stock,$D,$D+routed_experts --rounds 3 --steps 16 --warmup 4 --check-steps 8 \
    --pipelined-steps 16 --budget-s $(( $(left) / 2 - 20 )) --no-png --out $RES/decode.json
  stage verify_blocks $(( $(left) - 10 )) $B --layers 45 --experts 64 --sections verify --contexts 4096 \
    --prefill '' --verify-blocks 1,4 --arms stock,$D,$D+routed_experts --rounds 3 --steps 4 --warmup 1 \
    --check-steps 1 --budget-s $(( $(left) - 30 )) --no-png --out $RES/verify_blocks.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
