#!/usr/bin/env bash
# s40's device plan (issues 16 and 17). One foreground call per part on a warm machine; the caller tars /root/res
# to $OUT. Ran on two H100s (files benchmarks/h200/results/2026-12-06-h100-s40-m{1,2}-*): m1 l (12 blocks per
# arm and length, before the probe split async_eval from wait), t and w; m2 l (4 blocks), which ran out of its
# 175 s before printing anything. v, vl and b are for the next session, from branch swap's wheel.
# s41 ran, on one H100 (files benchmarks/h200/results/2026-12-06-h100-s41-*), from the swapped kernel's wheel: v
# (passed, 250 s cold), h200-s39.sh p (19 s), b (229 s), then l with BLOCKS=6 and per-piece primitive counts
# not yet in the probe (49 s).
# Part l: probe_verify_layers.py, a verify block of 1 and 4 tokens at 4,096 tokens of context, every layer evaluated
#   alone (build and evaluation per layer kind, a DSA layer's pieces): where a 4-token block's extra time goes. Arm
#   D = s39's decode set with routed_experts, kernels forced on.
# Part v: `verify routed_experts` (from branch swap: the operands swapped, the weights as the MMA's A).
# Part vl: v in the background while l runs (l's timings then share the GPU with the verify: its primitive counts
#   and its split of a block's time are what it is for there).
# Part b: s39's part b (decode and verify blocks of 1 and 4 at 4,096 tokens, stock vs A vs A + routed_experts).
# Part t: s39's part t (probe_expert_timeline.py); part w: s39's part w (probe_expert_swap.py).
# Usage: h200-s40.sh PART BUDGET
PART=${1:-l}
BUDGET=${2:-560}
HERE="$(dirname "$0")"
if [ "$PART" = t ] || [ "$PART" = w ] || [ "$PART" = b ]; then
  exec bash "$HERE/h200-s39.sh" "$PART" "$BUDGET"
fi
. "$HERE/stages.sh"
if [ "$PART" = v ] || [ "$PART" = vl ]; then
  ( VERIFY_LIMIT=$(( $(left) - 20 )) verify_all routed_experts ) &
  if [ "$PART" = v ]; then
    wait
    echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
    exit 0
  fi
fi
force_kernels
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel+routed_experts
stage layers $(( $(left) - 10 )) $PY "$HERE/probe_verify_layers.py" --arms ${ARMS:-$D} --blocks 1,4 --context 4096 \
  --blocks-timed ${BLOCKS:-10} --out $RES/probe_verify_layers.json
wait
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
