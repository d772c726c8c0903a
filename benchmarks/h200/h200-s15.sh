#!/usr/bin/env bash
# Eighth session (2026-12-01), in one detached run inside a budget:
# 1. CUDA `verify` of every patch that waits for one there, on the committed code (their digests moved:
#    checks/ relocation, one kernel builder, declared uses), in parallel, one state folder and kernel
#    cache each, with --report; the records merged for step 2;
# 2. decode at 45 layers, real widths, 64 experts, bf16, contexts 256 and 4096, arms interleaved:
#    stock, today's decode patches (D), D + layer_decode; synchronous and pipelined (async_eval) figures,
#    graph-build time and primitives per step (the bench's decode and graph sections);
# Start it detached (setsid) and collect /root/res later. Usage: h200-s15.sh BUDGET_SECONDS
# A dry run on a CPU: ROOT=/tmp/dry EXTRA="--small" SITE= VERIFY="compiled_kda_decode" benchmarks/h200/h200-s15.sh 600
BUDGET=${1:-1200}
. "$(dirname "$0")/stages.sh"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; python3 --version; } > $RES/machine.txt 2>&1
verify_all ${VERIFY:-compiled_kda_decode fused_kda_kernel hc_decode router_select expert_combine dsa_decode layer_decode dequantized_experts gathered_prefill vault_cache}
$PY -m glm53_patches.cli status > $RES/status.txt 2>&1
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode
stage decode 560 $B --layers ${LAYERS:-45} --experts ${EXPERTS:-64} --sections decode,graph --contexts ${CONTEXTS:-256,4096} \
  --prefill '' --arms stock,$D,$D+layer_decode --rounds 3 --steps 16 --warmup 4 --check-steps 8 --pipelined-steps 16 \
  --budget-s 520 --out $RES/decode.json
# 3. The same graph on tiny tensors (--small widths, 45 layers, 64 experts): if the time inside
#    async_eval stays, it is MLX encoding the primitives, not the GPU pushing back (issue 20's question).
stage tiny 150 $PY -m glm53_patches.bench --small --layers ${LAYERS:-45} --experts 64 --sections decode,graph \
  --contexts 256,4096 --prefill '' --arms stock,$D,$D+layer_decode --rounds 3 --steps 16 --warmup 4 --check-steps 4 \
  --pipelined-steps 16 --budget-s 140 --no-png --out $RES/tiny.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
