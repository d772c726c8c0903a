#!/usr/bin/env bash
# Tenth session (2026-12-02), in one detached run inside a budget:
# 1. CUDA `verify` of the decode patches the verify-block arms use (compiled_kda_decode's digest moved:
#    it now serves speculative verify blocks too), in parallel, one state folder and kernel cache each,
#    with --report; the records merged for step 2;
# 2. speculative verify blocks of 1 (a decode step), 2, 3 and 4 tokens at 45 layers, real widths, 64
#    experts, bf16, contexts 256 and 4096, arms interleaved: stock, today's decode patches (D),
#    D + layer_decode; every block checked bit for bit against stock (the bench's verify section).
# Start it detached (setsid) and collect /root/res later. Usage: h200-s16.sh BUDGET_SECONDS
# A dry run on a CPU: ROOT=/tmp/dry EXTRA="--small" SITE= VERIFY="compiled_kda_decode" benchmarks/h200/h200-s16.sh 600
BUDGET=${1:-1200}
. "$(dirname "$0")/stages.sh"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; python3 --version; } > $RES/machine.txt 2>&1
verify_all ${VERIFY:-compiled_kda_decode fused_kda_kernel hc_decode router_select expert_combine dsa_decode layer_decode}
$PY -m glm53_patches.cli status > $RES/status.txt 2>&1
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode
stage verify_blocks 700 $B --layers ${LAYERS:-45} --experts ${EXPERTS:-64} --sections verify --contexts ${CONTEXTS:-256,4096} \
  --prefill '' --verify-blocks 1,2,3,4 --arms stock,$D,$D+layer_decode --rounds 3 --steps 6 --warmup 2 --check-steps 2 \
  --budget-s 640 --out $RES/verify_blocks.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
