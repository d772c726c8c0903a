#!/usr/bin/env bash
# The next device plan (issue 16), one call on a fresh machine; the caller tars /root/res into $OUT.
# l: per-layer counts and times at blocks of 1 and 2 tokens (no --whole-only), arm D on main: what is
#    left of the fixed step from one token to two after s44 (+962 not-view primitives), layer kind by
#    layer kind, the input for a fused KDA block kernel. block_qmv's instantiations are compiled first,
#    12 processes at a time (s44: 36 s; the probe would otherwise compile them one by one).
# v: `verify block_qmv` on the view (31cc019, code digest b8a9b9733d68), its instantiations compiled first;
#    cold it needs about 500 s alone (s44: stock's kernels for the tiny models), so give it a whole call.
# t: a warm pass of main, then whole blocks of 1 to 4 tokens, arm D, separate processes: site1 (.whl1 =
#    main before 31cc019, the same kernels) and site (.whl = main) in turn; right after v, on its cache.
# Ran in s44: l (the table in BENCHMARKS.md, s44, that found the Gathers). v and t never ran: h200-s46.sh took
# them over.
# Usage: h200-s45.sh l|v|t BUDGET
PART=$1
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
case $PART in
l)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  stage precompile 120 $PY "$HERE/precompile_block_qmv.py" --jobs ${JOBS:-12} --real-positions 2
  force_kernels
  stage layers $(( $(left) - 10 )) "${BLOCK_PROBE[@]}" --blocks 1,2 --blocks-timed 4 --out $RES/layers.json ;;
v)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx-verify_block_qmv
  stage precompile 120 $PY "$HERE/precompile_block_qmv.py" --jobs ${JOBS:-12}
  VERIFY_LIMIT=$(( $(left) - 15 )) verify_all block_qmv ;;
t)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  force_kernels
  stage warm 240 "${BLOCK_PROBE[@]}" --blocks 1,2,3,4 --whole-only --blocks-timed 1 --out $RES/warm.json
  rotate "site1 site" "${BLOCK_PROBE[@]}" --blocks 1,2,3,4 --whole-only --blocks-timed ${BLOCKS:-10} ;;
esac
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
