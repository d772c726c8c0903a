#!/usr/bin/env bash
# Issue 17's first H200 session: exact_qmv (the decode projections' matvec, bit for bit MLX's qmv).
# The session had 20 device minutes, so all of it runs in one call, in the foreground, with
# /root/res tarred to $OUT by that call: micro_qmv (every decode projection at its real width,
# stock vs the kernel, and a sweep of launch shapes), CUDA `verify exact_qmv`, then what is left
# of BUDGET for the 45-layer decode step at 4,096 tokens: stock vs the six decode patches +
# layer_decode, without and with exact_qmv (kernels forced on: a fresh machine has no verify
# records but exact_qmv's), interleaved. One kernel cache, so the decode reuses compiled kernels.
# micro_qmv.py was then an earlier version (one kernel arm, "ours", at 4 passes ahead x 8 warps x
# 1 row, and a 12-shape sweep on qkv_proj and lm_head); the script in the tree is s28's.
# Usage: h200-s27.sh BUDGET
BUDGET=${1:-570}
. "$(dirname "$0")/stages.sh"
export MLX_PTX_CACHE_DIR=$ROOT/ptx
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; python3 --version; } > $RES/machine.txt 2>&1
stage micro_qmv 170 $PY "$(dirname "$0")/micro_qmv.py" --out $RES/micro_qmv.json
stage verify_exact_qmv 140 $PY -m glm53_patches.cli verify exact_qmv --report $RES/verify_exact_qmv.json
(
  export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
    GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1 GLM53_EXACT_QMV_KERNEL=1
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode
  stage decode $(left) $B --layers 45 --experts 64 --sections decode --contexts 4096 \
    --prefill '' --arms stock,$D,$D+exact_qmv --rounds 2 --steps 16 --warmup 4 --check-steps 8 --pipelined-steps 16 \
    --budget-s $(( $(left) - 15 )) --no-png --out $RES/decode.json
)
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
