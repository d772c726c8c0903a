#!/usr/bin/env bash
# s40's device plan (issues 16 and 17). One foreground call per part on a warm machine; the caller tars /root/res
# to $OUT.
# Part l: probe_verify_layers.py, a verify block of 1 and 4 tokens at 4,096 tokens of context, every layer evaluated
#   alone (build and evaluation per layer kind, a DSA layer's pieces): where a 4-token block's extra time goes. Arm
#   D = s39's decode set with routed_experts, kernels forced on.
# Part t: s39's part t (probe_expert_timeline.py); part w: s39's part w (probe_expert_swap.py).
# Usage: h200-s40.sh PART BUDGET
PART=${1:-l}
BUDGET=${2:-560}
HERE="$(dirname "$0")"
if [ "$PART" = t ] || [ "$PART" = w ]; then
  exec bash "$HERE/h200-s39.sh" "$PART" "$BUDGET"
fi
. "$HERE/stages.sh"
export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
  GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1 GLM53_BLOCK_QMV_KERNEL=1 GLM53_ROUTED_EXPERTS_KERNEL=1 \
  GLM53_KDA_VERIFY_KERNEL_KERNEL=1
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel+routed_experts
stage layers $(( $(left) - 10 )) $PY "$HERE/probe_verify_layers.py" --arms $D --blocks 1,4 --context 4096 \
  --blocks-timed 10 --out $RES/probe_verify_layers.json
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
