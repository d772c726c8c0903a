#!/usr/bin/env bash
# The next device plan (issue 16), one call on a fresh machine; the caller tars /root/res into $OUT.
# l: per-layer counts and times at blocks of 1 and 2 tokens (no --whole-only), arm D on main: what is
#    left of the fixed step from one token to two after s44 (+962 not-view primitives), layer kind by
#    layer kind, the input for a fused KDA block kernel. block_qmv's instantiations are compiled first,
#    12 processes at a time (s44: 36 s; the probe would otherwise compile them one by one).
# Usage: h200-s45.sh l BUDGET
PART=$1
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel+routed_experts
PROBE=($PY "$HERE/probe_verify_layers.py" --arms $D --context 4096 ${PROBE_EXTRA:-})
case $PART in
l)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  stage precompile 120 $PY "$HERE/precompile_block_qmv.py" --jobs ${JOBS:-12} --real-positions 2
  force_kernels
  stage layers $(( $(left) - 10 )) "${PROBE[@]}" --blocks 1,2 --blocks-timed 4 --out $RES/layers.json ;;
esac
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
