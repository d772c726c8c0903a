#!/usr/bin/env bash
# The s45 device plan (issue 16), two calls on one machine; the caller tars /root/res into $OUT.
# v: the CUDA verifies the code needs, side by side (each its own state folder and kernel cache), after
#    block_qmv's instantiations are compiled (12 processes; s44: 36 s):
#    - block_qmv on the view (31cc019, code digest b8a9b9733d68), never verified;
#    - kda_verify_kernel with its mixer kernel (a verify block's whole KDA mixer in one launch), new;
#    and cuDNN's depthwise conv order at block lengths 1-8 (probe_conv_order.py), which the mixer kernel's
#    in-order conv assumes.
# t: a warm pass of main, then whole blocks of 1 to 4 tokens, arm D, separate processes, in turn:
#    site1 (.whl1 = 4a2afac, s44's measured code), site2 (.whl2 = the Gathers removed, 31cc019's code) and
#    site (.whl = main, with the mixer kernel).
# Ran in s45 (BENCHMARKS.md, s45): v (kda_verify_kernel passed, 30 cases; block_qmv cut off at 447 s with 43 of
# 59 cases exact; the conv in order at every length), t with BUDGET 420 (one process per package: the counts
# exact, the times too noisy to decide), then inline `verify_all block_qmv` (cut off at 210 s) and one more
# site2 process.
# Ran in s46 (BENCHMARKS.md, s46): v with PRECOMPILE_EXTRA=--tiny-models NO_CONV=1 VERIFY=block_qmv (passed, 525 s
# in all), then t on a slow, drifting H100 (every process cut off at 90 s; stock's one-token block 87-141 ms).
# i: the whole blocks of 1 to 4 tokens interleaved in one process per package (--interleave: each round one
#    block of each length, so drift moves every length alike; the ratio to L = 1 per round), stock left out.
# Ran in s47 (BENCHMARKS.md, s47): i with SITES="site site2" (site = main, site2 = .whl2, 94e345f, without the
# mixer kernel), then four more interleaved processes, stock's, and one more pair; pool them with
# pool_interleaved.py. A 4-token block: 1.49x the one-token block (1.64x without the mixer kernel).
# Usage: [VERIFY="PATCH ..."] [SITES="SITE ..."] h200-s46.sh v|t|i BUDGET
PART=$1
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
case $PART in
v)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx-verify_block_qmv
  stage precompile ${PRECOMPILE_LIMIT:-120} $PY "$HERE/precompile_block_qmv.py" --jobs ${JOBS:-12} ${PRECOMPILE_EXTRA:-}
  [ -z "${NO_CONV:-}" ] && stage conv_order 60 $PY "$HERE/probe_conv_order.py"
  VERIFY_LIMIT=$(( $(left) - 15 )) verify_all ${VERIFY:-block_qmv kda_verify_kernel} ;;
t)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  force_kernels
  stage warm 240 "${BLOCK_PROBE[@]}" --blocks 1,2,3,4 --whole-only --blocks-timed 1 --out $RES/warm.json
  rotate "${SITES:-site1 site2 site}" "${BLOCK_PROBE[@]}" --blocks 1,2,3,4 --whole-only --blocks-timed ${BLOCKS:-10} ;;
i)
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
  force_kernels
  # One warm-up at a time: two real-width models do not fit an 80 GB card (s47 warmed both packages at
  # once: out of memory, and the first timed process, cold, was cut off at 150 s).
  stage warm 240 "${BLOCK_PROBE[@]}" --no-stock --blocks 1,2,3,4 --whole-only --blocks-timed 1 --out $RES/warm.json
  for round in 1 2; do
    for site in ${SITES:-site site2}; do
      (( $(left) < 100 )) && break 2
      PYTHONPATH=$ROOT/$site:$ROOT/site stage "interleaved-$site-$round" ${EACH:-150} "${BLOCK_PROBE[@]}" --no-stock \
        --blocks 1,2,3,4 --interleave --blocks-timed ${BLOCKS:-20} --out $RES/interleaved-$site-$round.json
    done
  done ;;
esac
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
