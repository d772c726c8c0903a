#!/usr/bin/env bash
# s44's device plan (issue 16), two calls on one warm machine; the caller tars /root/res into $OUT after
# each (a call returns at most 8 files). .whl = main (dsa_decode's selection kernel over a verify block's
# positions); .whl1 = main before it (b258c63: s42's narrower widths, one-row selection kernel).
# v: `verify dsa_decode` at once; beside it block_qmv's ~100 instantiations compiled 12 processes at a time
#    (precompile_block_qmv.py; s43 guessed they were why a cold `verify block_qmv` never ended inside
#    430 s), then `verify block_qmv` and a warm pass of arm D at blocks of 1 to 4 on that cache.
# t: whole blocks of 1 to 4 tokens, arm D, separate processes, site1 (.whl1) and site (.whl) in turn.
# Ran in s44: verify dsa_decode passed; the 97 instantiations took 36 s (1.5-3.6 s each), and the cold
# verify block_qmv still ran out (MLX compiling stock's kernels for the tiny models), then passed in 148 s
# when run again alone on that cache; t gave 1.60-1.62x at L = 4 against 1.71-1.74x before.
# Usage: h200-s44.sh v|t BUDGET
PART=$1
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
case $PART in
v)
  VERIFY_LIMIT=$(( BUDGET - 20 )) verify_all dsa_decode &
  (export MLX_PTX_CACHE_DIR=$ROOT/ptx-pre
   stage precompile 240 $PY "$HERE/precompile_block_qmv.py" --jobs ${JOBS:-12}
   for d in verify_block_qmv warm; do mkdir -p $ROOT/ptx-$d && cp -rn $ROOT/ptx-pre/. $ROOT/ptx-$d/ 2>/dev/null; done
   VERIFY_LIMIT=$(( $(left) - 15 )) verify_all block_qmv &
   (force_kernels; export MLX_PTX_CACHE_DIR=$ROOT/ptx-warm
    stage warm $(( $(left) - 15 )) "${BLOCK_PROBE[@]}" --blocks 1,2,3,4 --whole-only --blocks-timed 1 --out $RES/warm.json) &
   wait) &
  wait
  merge_ptx ;;
t)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  force_kernels
  rotate "site1 site" "${BLOCK_PROBE[@]}" --blocks 1,2,3,4 --whole-only --blocks-timed ${BLOCKS:-10} ;;
esac
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
