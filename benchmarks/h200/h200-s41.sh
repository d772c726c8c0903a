#!/usr/bin/env bash
# s41's device plan (issue 16): a verify block's dense per-position matvecs as one batched gemv on CUDA
# (glm53_patches/kernels/rowwise.py, in hc_decode's mix and router_select's logits). One foreground call per part
# on a warm machine; the caller tars /root/res to $OUT.
# Part v: `verify` of hc_decode and router_select, in parallel (layer_decode, which traces both, if named: VERIFY).
# Part a: probe_rowwise.py (the batched gemv against tokenwise, bit for bit and timed, per shape), then
#   probe_verify_layers.py --whole-only, blocks of 1 and 4 at 4,096 tokens, arm D (s40's), alternating the
#   package before the change (/root/site0, from .whl0) and after it (/root/site) in separate processes: A B A B.
# Ran in s41 on one H100 with 247 s of budget left: a (files benchmarks/h200/results/2026-12-06-h100-s41-rowwise.*):
#   probe_rowwise passed (every case bit-identical); the A/B processes did not (site0 lacked mlx, fixed since, and the
#   first cold process ran past its limit, now 150 s). Part v has not run. Next: a then v (VERIFY="hc_decode
#   router_select"; hc_decode's took 336 s cold on an H200), about 12 minutes warm.
# Usage: h200-s41.sh PART BUDGET
PART=${1:-v}
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
if [ "$PART" = v ]; then
  VERIFY_LIMIT=$(( $(left) - 20 )) verify_all ${VERIFY:-hc_decode router_select}
else
  stage rowwise 60 $PY "$HERE/probe_rowwise.py" --out $RES/probe_rowwise.json
  force_kernels
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel+routed_experts
  # site0 holds only the wheel: mlx and mlx-vlm come from site, behind it
  for round in 1 2; do
    for site in site0 site; do
      PYTHONPATH=$ROOT/$site:$ROOT/site stage "whole-$site-$round" 150 $PY "$HERE/probe_verify_layers.py" \
        --arms $D --blocks 1,4 --context 4096 --blocks-timed ${BLOCKS:-10} --whole-only \
        --out $RES/whole-$site-$round.json
    done
  done
  # then every layer alone, after the change: its pieces' CUDA primitives, L=4 against L=1
  stage layers $(( $(left) - 10 )) $PY "$HERE/probe_verify_layers.py" --arms $D --blocks 1,4 --context 4096 \
    --blocks-timed 4 --out $RES/probe_verify_layers.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
