#!/usr/bin/env bash
# Session 34's verify-block run. s33's part b (h200-s33.sh) showed block_qmv never running in the bench:
# nn.quantize's new Quantized* modules start in training mode, so stock's `linear` sent every block
# projection through module(x), not the singleton gather a loaded (eval) model takes. With the
# synthetic model now in eval mode, this times blocks of 1, 2 and 4 tokens at 4,096 tokens of context,
# stock against D + layer_decode with and without block_qmv, kernels forced on, every block checked
# against stock bit for bit; then, if time is left, the micro rows s34 did not reach (dense MLP, lm_head).
# One foreground call on a cold machine: the caller tars /root/res to $OUT.
# Part v first: block_qmv's CUDA record, owed again since its Metal twin changed the patch's Python
# (code digest a15995c7ce76 after s35's cleanup; the CUDA kernel text is pinned unchanged). It needs its own call: in
# parallel with other verifies it did not finish in 530 s (s34), alone it took 147 s warm.
# Usage: h200-s34.sh PART BUDGET   (PART v: verify block_qmv; b: the blocks, then the micro rows)
PART=${1:-b}
BUDGET=${2:-540}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = v ]; then
  VERIFY_LIMIT=$(( $(left) - 20 )) verify_all block_qmv
  echo "$(date +%T) part v done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
  exit 0
fi
export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
  GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1 GLM53_BLOCK_QMV_KERNEL=1
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode
stage verify_blocks $(( $(left) - 15 )) $B --layers 45 --experts 64 --sections verify --contexts 4096 \
  --prefill '' --verify-blocks ${BLOCKS:-1,2,4} --arms stock,$D,$D+block_qmv --rounds 3 --steps 4 --warmup 1 \
  --check-steps 1 --budget-s $(( $(left) - 40 )) --no-png --out $RES/verify_blocks.json
# what s34's micro run did not reach (it stopped at 210 s), if time is left
stage micro_rest $(( $(left) - 10 )) $PY "$(dirname "$0")/micro_block_qmv.py" --positions 2,4,7 \
  --only "shared expert down,dense MLP gate_up,dense MLP down,lm_head" --out $RES/micro_block_qmv_rest.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
