#!/usr/bin/env bash
# The s48 device plan (issue 17), two calls on one machine; the caller tars /root/res into $OUT.
# v: CUDA `verify routed_experts` on the code with the Metal twin (the CUDA path unchanged, the code digest new).
# b: issue 17's whole-step figure: A (the exact decode set without issue 17's patches) against A + exact_qmv +
#    routed_experts, 45 layers at real widths, 64 experts, bf16, 4,096 tokens, every kernel forced on.
# Usage: h200-s48.sh v|b BUDGET
PART=$1
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
case $PART in
v)
  VERIFY_LIMIT=$(( $(left) - 15 )) verify_all routed_experts ;;
b)
  force_kernels
  export GLM53_EXACT_QMV_KERNEL=1
  A=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode
  stage decode $(( $(left) - 10 )) $B --layers 45 --experts 64 --sections decode --contexts 4096 --prefill '' \
    --arms $A,$A+exact_qmv+routed_experts --rounds ${ROUNDS:-5} --steps 24 --warmup 4 --check-steps 4 \
    --pipelined-steps 24 --budget-s $(( $(left) - 30 )) --no-png --out $RES/decode.json ;;
esac
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
