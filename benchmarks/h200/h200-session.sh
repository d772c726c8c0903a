#!/usr/bin/env bash
# One H200 session's measurements, in priority order, inside a wall-clock budget.
# Started detached (setsid) by the first measuring call (copy the whole device/
# folder: it sources stages.sh); later calls only collect /root/res. Assumes the MLX CUDA wheel, mlx-vlm and this package are installed in
# /root/site (see BENCHMARKS.md). Usage: h200-session.sh BUDGET_SECONDS
# A dry run on a CPU: ROOT=/tmp/dry EXTRA="--small" SITE=  benchmarks/h200/h200-session.sh 300
BUDGET=${1:-1300}
. "$(dirname "$0")/stages.sh"
export GLM53_INDEXER_FP32_KERNEL=1  # indexer_fp32 arms run its CUDA kernel (checked by quality --kernel)

{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; python3 --version; } > $RES/machine.txt 2>&1

# 1. Untimed, in parallel: exactness checks, quality gates, and kernel compilation
#    warm-ups (one PTX cache each, merged after: NVRTC is single-threaded per process).
W="$W --budget-s 280"
par verify 300 $PY -m glm53_patches.cli verify compiled_kda_decode dsa_decode gathered_prefill hc_decode
par indexer_quality 300 $PY -m glm53_patches.patches.indexer_fp32.checks.quality --kernel
par kda_device_check 300 $PY -m glm53_patches.patches.kda_prefill_kernel.checks.device_check --out $RES/kda_device_check.json
par warm_step 300 env GLM53_HC_DECODE_KERNEL=1 $B --experts 8 --sections decode --contexts 256 $W \
  --arms stock,compiled_kda_decode,hc_decode,dsa_decode,all --out $ROOT/warm/step.json
par warm_layers 300 $B --layers 5 --experts 8 --sections kda,moe,dsa,prefill_kda,prefill_dsa --contexts 4096 \
  --prefill 2048 $W --arms stock,compiled_kda_decode,hc_decode,dsa_decode,gathered_prefill,kda_prefill_kernel,indexer_fp32 \
  --out $ROOT/warm/layers.json
par warm_prefill 300 $B --experts 8 --sections prefill --prefill 2048 $W --arms stock,all+kda_prefill_kernel \
  --out $ROOT/warm/prefill.json
wait
merge_ptx
$PY -m glm53_patches.cli status > $RES/status.txt 2>&1
du -sh $ROOT/ptx >> $RES/machine.txt

# 2. Timed, one at a time.
R="--no-png"
stage step 300 $B --experts 64 --sections bandwidth,decode,graph --contexts 256,4096 \
  --arms stock,compiled_kda_decode,hc_decode,dsa_decode,all --rounds 2 --steps 16 --warmup 3 --check-steps 4 \
  --budget-s 260 --out $RES/step.json
stage layers 240 $B --layers 5 --experts 64 --sections kda,moe,dsa --contexts 4096,16384,32768 \
  --arms stock,compiled_kda_decode,hc_decode,dsa_decode,all --rounds 3 --budget-s 200 --out $RES/layers.json
stage prefill_kda 150 $B --layers 5 --experts 64 --sections prefill_kda --prefill 4096,16384,32768 \
  --prefill-rounds 1 --arms stock,kda_prefill_kernel --budget-s 120 --out $RES/prefill_kda.json
stage prefill_dsa 200 $B --layers 5 --experts 64 --sections prefill_dsa --prefill 4096,16384,32768 \
  --prefill-rounds 1 --arms stock,gathered_prefill,indexer_fp32,gathered_prefill+indexer_fp32 \
  --budget-s 170 --out $RES/prefill_dsa.json
stage vault_ttft 300 $PY -m glm53_patches.patches.vault_cache.checks.ttft $( [ -n "$EXTRA" ] && echo --small ) \
  --patches gathered_prefill,kda_prefill_kernel --prompts 4096,16384 --budget-s 270 --dir $ROOT/ttft --out $RES/vault_ttft.json
pkill -f vault_cache.ttft; cp $ROOT/ttft/result-*.json $RES/ 2>/dev/null
stage prefill_model 200 $B --experts 64 --sections prefill --prefill 4096 --prefill-rounds 1 \
  --arms stock,all+kda_prefill_kernel --budget-s 180 --out $RES/prefill_model.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
