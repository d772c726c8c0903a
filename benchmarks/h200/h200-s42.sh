#!/usr/bin/env bash
# s42's device plan (issue 16): block_qmv takes the 128-wide KDA projections too (f_b_proj, g_b_proj), which
# stock runs as a one-row qmv per position in a verify block. One foreground call on a warm machine; the
# caller tars /root/res into $OUT (a call returns at most 8 files: s42 lost the "before" processes' files).
# 1. `verify block_qmv` alone (it matters more than the timing), then one short whole-block pass of arm D
#    after the change, which compiles every other kernel the timed runs need.
# 2. probe_verify_layers.py --whole-only, blocks of 1 and 4 at 4,096 tokens, arm D, alternating the package
#    before the change (/root/site0, from .whl0: main before it) and after it (/root/site), in separate
#    processes: A B A B A B while the budget lasts.
# Ran in s42 on a second H100 with 1 and 2 side by side: verify did not finish inside 300 s beside the cold
# compile, and the A/B did not settle (L = 1, the same code in both, differed by a third between processes).
# 3. probe_dsa_block.py: can a DSA layer's per-position attention loop in a block run over all positions at
#    once, bit for bit? (the next host cost to take off, if it can)
# Next: this plan as it stands now, about 10 minutes from cold.
# Usage: h200-s42.sh BUDGET
BUDGET=${1:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel+routed_experts
# arm D's whole blocks of 1 and 4 tokens (PROBE_EXTRA: e.g. "--small --context 256" for a CPU dry run)
PROBE=($PY "$HERE/probe_verify_layers.py" --arms $D --blocks 1,4 --context 4096 --whole-only
  ${PROBE_EXTRA:-})
export MLX_PTX_CACHE_DIR=$ROOT/ptx
GLM53_PATCHES_STATE_DIR=$ROOT/state stage verify_block_qmv 360 $PY -m glm53_patches.cli verify block_qmv \
  --report $RES/verify_block_qmv.json
force_kernels
stage warm 240 "${PROBE[@]}" --blocks-timed 1 --out $RES/warm.json
for round in 1 2 3; do
  for site in site0 site; do
    (( $(left) < 60 )) && break 2
    PYTHONPATH=$ROOT/$site:$ROOT/site stage "whole-$site-$round" 90 "${PROBE[@]}" --blocks-timed ${BLOCKS:-10} \
      --out $RES/whole-$site-$round.json
  done
done
stage dsa_block 90 $PY "$HERE/probe_dsa_block.py" --out $RES/dsa_block.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
