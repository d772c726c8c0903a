#!/usr/bin/env bash
# The next device plan (issue 16), three calls on one warm machine; the caller tars /root/res into $OUT
# after each (a call returns at most 8 files). .whl = main; .whl0 = main before s42's narrower widths.
# v: `verify block_qmv` alone, with the whole call (s42 and s43 never saw it end; its per-case lines now
#    say where the time goes), and beside it one warm pass of arm D at blocks of 1 to 4 on main's code.
# l: per-layer counts and times at blocks of 1 and 2 tokens (no --whole-only): what the fixed step from
#    one token to two is made of, layer kind by layer kind (s43: +1,567 not-view primitives, then about
#    +100 a token), the input for a fused KDA block kernel.
# t: whole blocks of 1 to 4 tokens, arm D, separate processes, site0 (.whl0) and site (.whl) in turn.
# Usage: h200-s44.sh v|l|t BUDGET
PART=$1
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel+routed_experts
PROBE=($PY "$HERE/probe_verify_layers.py" --arms $D --context 4096 ${PROBE_EXTRA:-})
case $PART in
v)
  VERIFY_LIMIT=$BUDGET verify_all block_qmv &
  (force_kernels; export MLX_PTX_CACHE_DIR=$ROOT/ptx-warm
   stage warm $BUDGET "${PROBE[@]}" --blocks 1,2,3,4 --whole-only --blocks-timed 1 --out $RES/warm.json) &
  wait
  merge_ptx ;;
l)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  force_kernels
  stage layers $(( $(left) - 10 )) "${PROBE[@]}" --blocks 1,2 --blocks-timed 4 --out $RES/layers.json ;;
t)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  force_kernels
  rotate "site0 site" "${PROBE[@]}" --blocks 1,2,3,4 --whole-only --blocks-timed ${BLOCKS:-10} ;;
esac
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
