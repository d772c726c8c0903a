#!/usr/bin/env bash
# Next session's plan (not yet run): what s28 left owed, in two foreground calls of one machine
# (each tars /root/res to $OUT itself):
#   part 1: CUDA verify of layer_decode (its digest changed when it began composing exact_qmv),
#           exact_qmv (again, on that machine) and dequantized_experts (s26: the 288-expert split),
#           in parallel, records merged into /root/state; then the split's micro-benchmark;
#   part 2, in the next call at once: the 45-layer decode step at 256 and 4,096 tokens, the decode
#           set + layer_decode without and with exact_qmv, 5 interleaved rounds (s28 had 2, and one
#           slow round made its medians overstate exact_qmv's gain). Verified kernels run by `auto`;
#           the other decode patches' kernels are forced on, as in s28.
# Usage: h200-s29.sh PART BUDGET
PART=${1:-1}
BUDGET=${2:-560}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = 1 ]; then
  verify_all layer_decode exact_qmv dequantized_experts
  stage micro_split_experts 100 $PY "$(dirname "$0")/micro_split_experts.py" --out $RES/micro_split_experts.json
else
  merge_ptx
  export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
    GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode
  stage decode $(( BUDGET - 20 )) $B --layers 45 --experts 64 --sections decode --contexts 256,4096 \
    --prefill '' --arms stock,$D,$D+exact_qmv --rounds 5 --steps 16 --warmup 4 --check-steps 8 --pipelined-steps 16 \
    --budget-s $(( BUDGET - 40 )) --no-png --out $RES/decode.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
