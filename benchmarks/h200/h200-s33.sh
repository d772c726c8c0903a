#!/usr/bin/env bash
# Session 33's plan for the next session with a machine (s33 itself had none: 28 s of device time).
# Each part is one foreground call that tars /root/res to $OUT itself; run them on one warm machine:
#   part v: CUDA verify, in parallel, of block_qmv (new, never run on a GPU), layer_decode (its
#           COMPOSES gained block_qmv: a new digest) and the three prefill patches whose records
#           s31/s32 still owe (exact_kda_prefill needs more than the 125 s s32 gave it;
#           dequantized_linear, dequantized_experts);
#   part m: micro_block_qmv.py: each block projection at 2, 4 and 7 positions, stock's gather_qmv
#           against the kernel at four launch shapes, GB/s, bit for bit;
#   part b: verify blocks at 4,096 tokens (1, 2 and 4 tokens), stock against D + layer_decode with
#           and without block_qmv, kernels forced on, every block checked against stock bit for bit:
#           does the 4-token block come within issue 16's 1.5x of the one-token step?
# Usage: h200-s33.sh PART BUDGET
PART=${1:-v}
BUDGET=${2:-560}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = v ]; then
  VERIFY_LIMIT=$(( $(left) - 30 )) verify_all ${VERIFY:-block_qmv layer_decode exact_kda_prefill dequantized_linear \
    dequantized_experts}
elif [ "$PART" = m ]; then
  stage micro_block_qmv $(( $(left) - 20 )) $PY "$(dirname "$0")/micro_block_qmv.py" --out $RES/micro_block_qmv.json
else
  export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
    GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1 GLM53_BLOCK_QMV_KERNEL=1
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode
  stage verify_blocks $(( $(left) - 20 )) $B --layers 45 --experts 64 --sections verify --contexts 4096 \
    --prefill '' --verify-blocks 1,2,4 --arms stock,$D,$D+block_qmv --rounds 3 --steps 6 --warmup 2 \
    --check-steps 2 --budget-s $(( $(left) - 40 )) --no-png --out $RES/verify_blocks.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
