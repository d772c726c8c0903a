#!/usr/bin/env bash
# Fifth session's last H200 run: fused_kda_kernel with the conv window and the
# depthwise conv moved into the kernel (cuDNN's tap order, from
# probe_conv_order.py): verify it, then the 45-layer step again.
# Same setup as h200-session.sh. Usage: h200-s10.sh BUDGET_SECONDS
BUDGET=${1:-500}
. "$(dirname "$0")/stages.sh"
verify() { GLM53_PATCHES_STATE_DIR=$ROOT/state-$1 par verify_$1 $2 $PY -m glm53_patches.cli verify $1; }
verify fused_kda_kernel 330
export GLM53_HC_DECODE_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 GLM53_EXPERT_COMBINE_KERNEL=1 \
  GLM53_DSA_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1
BEST=compiled_kda_decode+dsa_decode+hc_decode+router_select+expert_combine
ARMS=stock,$BEST,$BEST+fused_kda_kernel
par warm_step 330 $B --experts 8 --sections decode --contexts 256 $W --budget-s 300 --arms $ARMS \
  --out $ROOT/warm/step.json
wait
merge_ptx
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null
stage step 150 $B --experts 64 --sections decode,graph --contexts 256,4096 --arms $ARMS \
  --rounds 3 --steps 16 --warmup 3 --check-steps 4 --budget-s 130 --no-png --out $RES/step.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
