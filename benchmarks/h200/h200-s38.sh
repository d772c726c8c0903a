#!/usr/bin/env bash
# s38's device plan for kda_verify_kernel (written in s37 without a GPU). Run in s38 on an H100: v passed for both
# patches, b twice (files benchmarks/h200/results/2026-12-06-h100-s38-*; BENCHMARKS.md, s38).
# One foreground call per part on a warm machine; the caller tars /root/res to $OUT.
# Part v: `verify kda_verify_kernel` (cases at 4x64 and 64x128; a cold start compiles one kernel per shape, token
#   count and history length: give it 400 s or more), beside `verify layer_decode`: s37 added kda_verify_kernel to
#   its COMPOSES and _SWITCHES, which moved its code digest (6e6df59d217c, verified in s36 -> ac5fcc0940d0).
# Part b: verify blocks of 1, 3 and 4 at 4,096 tokens, D against D + kda_verify_kernel, kernels forced (its knob
#   too), each arm bit for bit against stock. D as in s36/s37, with routed_experts.
# Part c: blocks of 1 and 4 at 256 and 4,096 tokens, stock against D + kda_verify_kernel: how much of a block's
#   extra cost grows with the context (each position's attention) and how much does not.
# Usage: h200-s38.sh PART BUDGET
PART=${1:-v}
BUDGET=${2:-560}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = v ]; then
  VERIFY_LIMIT=$(( $(left) - 20 )) verify_all kda_verify_kernel layer_decode
else  # b and c: every kernel forced, kda_verify_kernel's too
  force_kernels
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+routed_experts
  if [ "$PART" = c ]; then
    stage contexts $(( $(left) - 10 )) $B --layers 45 --experts 64 --sections verify --contexts 256,4096 \
      --verify-blocks 1,4 --prefill '' --arms stock,$D+kda_verify_kernel --rounds 5 --steps 12 --warmup 3 \
      --check-steps 3 --budget-s $(( $(left) - 30 )) --no-png --out $RES/verify_contexts.json
  else
    stage verify $(( $(left) - 10 )) $B --layers 45 --experts 64 --sections verify --contexts 4096 \
      --verify-blocks 1,3,4 --prefill '' --arms stock,$D,$D+kda_verify_kernel --rounds 5 --steps 12 --warmup 3 \
      --check-steps 3 --budget-s $(( $(left) - 30 )) --no-png --out $RES/verify_blocks.json
  fi
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
