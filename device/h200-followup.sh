#!/usr/bin/env bash
# The second H200 session of 2026-11-30: what the first one (h200-session.sh)
# left open. Same setup and usage: h200-followup.sh BUDGET_SECONDS
set -u
BUDGET=${1:-600}
START=$(date +%s)
ROOT=${ROOT:-/root}
EXTRA=${EXTRA:-}
RES=$ROOT/res
mkdir -p $RES $ROOT/state $ROOT/warm
export PYTHONPATH=${SITE-/root/site} PYTHONUNBUFFERED=1 GLM53_PATCHES_STATE_DIR=$ROOT/state
export GLM53_HC_DECODE_KERNEL=1  # hc_decode's CUDA kernel on, also before `verify hc_decode` has passed
PY="python3 -X faulthandler"
B="$PY -m glm53_patches.bench $EXTRA"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local l=$(left)
  if (( l < 30 )); then echo "$(date +%T) skip $name (budget spent)" >> $RES/stages.txt; return; fi
  (( limit > l )) && limit=$l
  echo "$(date +%T) start $name (limit ${limit}s)" >> $RES/stages.txt
  timeout -k 5 $limit "$@" > $RES/$name.log 2>&1
  local rc=$?
  echo "$(date +%T) end $name rc=$rc after $(( $(date +%s) - START ))s" >> $RES/stages.txt
}
par() { local name=$1; shift; ( export MLX_PTX_CACHE_DIR=$ROOT/ptx-$name; stage "$name" 230 "$@" ) & }

W="--rounds 1 --steps 1 --warmup 0 --check-steps 1 --no-png --quiet --budget-s 220"
par verify $PY -m glm53_patches.cli verify compiled_kda_decode hc_decode
par indexer_quality $PY -m glm53_patches.patches.indexer_fp32.quality --kernel
par warm_step $B --experts 8 --sections decode --contexts 256 $W --arms stock,hc_decode --out $ROOT/warm/step.json
par warm_dsa $B --layers 5 --experts 8 --sections prefill_dsa --prefill 2048 $W --arms stock,latent_prefill \
  --out $ROOT/warm/dsa.json
wait
mkdir -p $ROOT/ptx && for d in $ROOT/ptx-*; do cp -rn "$d"/. $ROOT/ptx/ 2>/dev/null; done
export MLX_PTX_CACHE_DIR=$ROOT/ptx

stage step 170 $B --experts 64 --sections decode,graph --contexts 256,4096 \
  --arms stock,hc_decode,compiled_kda_decode+dsa_decode+hc_decode --rounds 2 --steps 12 --warmup 2 \
  --check-steps 3 --budget-s 150 --no-png --out $RES/step_hc.json
stage prefill_dsa 120 $B --layers 5 --experts 64 --sections prefill_dsa --prefill 4096,16384 \
  --prefill-rounds 1 --arms stock,latent_prefill --budget-s 100 --no-png --out $RES/prefill_dsa_latent.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
