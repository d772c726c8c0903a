#!/usr/bin/env bash
# Fifth session's second H200 run (the first verified fused_kda_kernel and timed
# the KDA layer): probes for the next kernels, verify dsa_decode's multi-warp
# selection, then the 45-layer step with every decode kernel, the DSA layer at
# 4k-32k and the DSA indexer past 16k keys. Same setup as
# h200-session.sh. Usage: h200-s9.sh BUDGET_SECONDS
BUDGET=${1:-900}
. "$(dirname "$0")/stages.sh"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; python3 --version; } > $RES/machine.txt 2>&1

# 1. Untimed, in parallel, each in its own state folder and kernel cache.
stage probe 60 $PY benchmarks/h200/probe_conv.py
verify() { GLM53_PATCHES_STATE_DIR=$ROOT/state-$1 par verify_$1 $2 $PY -m glm53_patches.cli verify $1; }
verify dsa_decode 330
export GLM53_HC_DECODE_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 GLM53_EXPERT_COMBINE_KERNEL=1 \
  GLM53_DSA_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1
BEST=compiled_kda_decode+dsa_decode+hc_decode+router_select+expert_combine
ARMS=stock,$BEST,$BEST+fused_kda_kernel
par warm_step 330 $B --experts 8 --sections decode --contexts 256 $W --budget-s 300 --arms $ARMS \
  --out $ROOT/warm/step.json
wait
merge_ptx
cat $ROOT/state-*/verified.json > $RES/verified.txt 2>/dev/null

# 2. Timed, one at a time (kernels forced on: each arm's own check says
#    whether it stayed bit-identical to stock).
stage step 300 $B --experts 64 --sections decode,graph --contexts 256,4096 --arms $ARMS \
  --rounds 3 --steps 16 --warmup 3 --check-steps 4 --budget-s 280 --no-png --out $RES/step.json
stage dsa 200 $B --layers 5 --experts 64 --sections dsa --contexts 4096,16384,32768 --arms stock,dsa_decode \
  --rounds 3 --steps 16 --budget-s 180 --no-png --out $RES/dsa.json
stage dsa_indexer 120 $PY -m glm53_patches.patches.dsa_decode.checks.bench --pieces indexer \
  --contexts 4096,16384,32768,65536,131072 --rounds 6 --steps 20
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
