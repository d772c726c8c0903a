#!/usr/bin/env bash
# s43's device plan (issue 16), two calls on one warm machine; the caller tars /root/res into $OUT after
# each (a call returns at most 8 files).
# v: side by side, each with its own kernel cache: `verify layer_decode` (its DSA back now runs a block's
#    positions as one batch), `verify block_qmv` (s42's narrower widths; it did not finish in s42),
#    probe_dsa_block.py (the bits of each batched piece at real shapes; its timings are a hint only beside
#    the compiles), and one warm pass of arm D at blocks of 1 to 4 (compiles what t runs).
# t: probe_verify_layers.py --whole-only, blocks of 1 to 4 tokens at 4,096 tokens of context, arm D, in
#    separate processes, rotating three packages: /root/site0 (.whl0: before block_qmv's narrower widths),
#    /root/site1 (.whl1: with them) and /root/site (.whl: and the batched DSA back), while the budget lasts.
# Ran in s43 (an H100): v with .whl = the batched DSA back (3d16ca6 withdrew it): the probe found no piece
# bit-identical and `verify layer_decode` failed; `verify block_qmv` did not finish in 430 s, nor then alone
# in 290 s on its kernel cache. t (SITES="site0 site1", 255 s) got two site0 processes and most of one
# site1: the warm pass had compiled the batched code, so site1 compiled its own graphs inside its 90 s.
# Next: h200-s44.sh.
# Usage: h200-s43.sh v|t BUDGET
PART=$1
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel+routed_experts
PROBE=($PY "$HERE/probe_verify_layers.py" --arms $D --blocks 1,2,3,4 --context 4096 --whole-only ${PROBE_EXTRA:-})
if [ "$PART" = v ]; then
  VERIFY_LIMIT=$BUDGET verify_all layer_decode block_qmv &
  par dsa_block 150 $PY "$HERE/probe_dsa_block.py" --out $RES/dsa_block.json
  (force_kernels; export MLX_PTX_CACHE_DIR=$ROOT/ptx-warm
   stage warm $BUDGET "${PROBE[@]}" --blocks-timed 1 --out $RES/warm.json) &
  wait
  merge_ptx
else
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  force_kernels
  rotate "${SITES:-site0 site1 site}" "${PROBE[@]}" --blocks-timed ${BLOCKS:-10}
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
