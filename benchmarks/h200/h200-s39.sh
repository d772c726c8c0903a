#!/usr/bin/env bash
# s39's device plan for routed_experts' kernel (issue 17) and one measurement for issue 16. Ran on three H100s
# (files benchmarks/h200/results/2026-12-06-h100-s39-m{1,2,3}-*; BENCHMARKS.md, s39):
#   m1: p with a leaner kernel (fewer instructions per MMA: -m1-lean_kernel.diff), then c;
#   m2: s, v, b. v was meant for a cp.async kernel installed into a second folder, but that install left the old
#       code (the record's digest is s37's), so it re-verified s37's kernel; that cp.async kernel was no faster (s);
#   m3: p with the block's prologue rewritten (-m3-prologue_kernel.diff), then v, which ran out of its 270 s cold.
# One foreground call per part on a warm machine; the caller tars /root/res to $OUT.
# Part p: probe_expert_mma.py with s37's kernel as the baseline (.dev-wb/kernel_s37.py: `git show
#   54b81c0:glm53_patches/patches/routed_experts/kernel.py`), bit for bit against gather_qmm and timed side by side.
# Part s: probe_expert_stage.py (the kernel's arithmetic with its weights copied by cp.async into a ring of slots).
# Part v: `verify routed_experts` (s37's kernel: 229-244 s cold, 112 s warm; give a cold one 400 s).
# Part b: decode and verify blocks of 1 and 4 at 4,096 tokens, stock vs A vs A + routed_experts, kernels forced
#   on, A = s38's decode set without routed_experts (kda_verify_kernel included; exact_qmv is not in it).
# Part c: as h200-s38.sh c (blocks of 1 and 4 at 256 and 4,096 tokens, for issue 16).
# Part t (written after the runs, not run in s39): probe_expert_timeline.py, the patch's kernel with timestamps
#   per warp (launch ramp, prologue, first and steady steps, tail, warps per SM); about a minute warm.
# Part w (written after the runs, not run in s39): probe_expert_swap.py, the weights as the MMA's A operand and the
#   input as B (half the MMAs), bit for bit against gather_qmm and timed beside the patch's kernel. Ran in s40; since
#   s41 its text is the patch's kernel and the probe is gone (git show c5f574d:benchmarks/h200/probe_expert_swap.py).
# Usage: h200-s39.sh PART BUDGET
PART=${1:-p}
BUDGET=${2:-560}
HERE="$(dirname "$0")"
if [ "$PART" = c ]; then
  exec bash "$HERE/h200-s38.sh" c "$BUDGET"
fi
. "$HERE/stages.sh"
if [ "$PART" = v ]; then
  VERIFY_LIMIT=$(( $(left) - 20 )) verify_all routed_experts
elif [ "$PART" = w ]; then
  stage swap $(( $(left) - 10 )) $PY "$HERE/probe_expert_swap.py" --out $RES/probe_expert_swap.json
elif [ "$PART" = t ]; then
  stage timeline $(( $(left) - 10 )) $PY "$HERE/probe_expert_timeline.py" --out $RES/probe_expert_timeline.json
elif [ "$PART" = s ]; then
  stage stage $(( $(left) - 10 )) $PY "$HERE/probe_expert_stage.py" --out $RES/probe_expert_stage.json
elif [ "$PART" = p ]; then
  stage probe $(( $(left) - 10 )) $PY "$HERE/probe_expert_mma.py" --baseline .dev-wb/kernel_s37.py \
    --out $RES/probe_expert_mma.json
else
  force_kernels
  A=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel
  stage decode $(( $(left) - 10 )) $B --layers 45 --experts 64 --sections decode,verify --contexts 4096 \
    --verify-blocks 1,4 --prefill '' --arms stock,$A,$A+routed_experts --rounds 5 --steps 24 --warmup 4 \
    --check-steps 4 --pipelined-steps 24 --budget-s $(( $(left) - 30 )) --no-png --out $RES/decode.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
