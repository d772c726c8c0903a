# Sourced by the H200 session scripts: paths, environment, and `stage`, `par` and
# `merge_ptx`, which run measurements inside the wall-clock budget BUDGET (seconds).
# ROOT (default /root), EXTRA (extra bench options, e.g. --small for a CPU dry
# run) and SITE (PYTHONPATH; default /root/site) may be set by the caller.
# Collect with polls that first check `test -d /root/res || exit 3`: a poll that
# comes after the machine's idle release lands on a fresh, bare machine.
# Better, where a plan fits in one call (600 s): run it in the foreground and tar
# /root/res to $OUT in the same call. Nothing is then lost to a late poll (s24).
set -u
START=$(date +%s)
ROOT=${ROOT:-/root}
EXTRA=${EXTRA:-}
RES=$ROOT/res
mkdir -p $RES $ROOT/state $ROOT/warm
export PYTHONPATH=${SITE-/root/site} PYTHONUNBUFFERED=1 GLM53_PATCHES_STATE_DIR=$ROOT/state
PY="python3 -X faulthandler"
B="$PY -m glm53_patches.bench $EXTRA"
W="--rounds 1 --steps 1 --warmup 0 --check-steps 1 --no-png --quiet"  # a warm-up run: compiles, times nothing

# Arm D of the verify-block probes (s40 on): every exact decode patch, and each one's kernel in force_kernels.
ARM_D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode+block_qmv+kda_verify_kernel+routed_experts
BLOCK_PROBE=($PY "$(dirname "${BASH_SOURCE[0]}")/probe_verify_layers.py" --arms $ARM_D --context 4096 ${PROBE_EXTRA:-})

force_kernels() {  # every decode kernel on, verified here or not (timing runs; `verify` forces its own)
  export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
    GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1 GLM53_BLOCK_QMV_KERNEL=1 GLM53_ROUTED_EXPERTS_KERNEL=1 \
    GLM53_KDA_VERIFY_KERNEL_KERNEL=1
}

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

rotate() {  # rotate "SITES" COMMAND...: COMMAND in separate processes, 90 s each, each package of SITES in
  # turn ($ROOT/<site> before $ROOT/site on PYTHONPATH), up to 3 rounds while a minute of budget is left;
  # each run is stage whole-<site>-<round>, writing --out $RES/whole-<site>-<round>.json
  local sites=$1 round site; shift
  for round in 1 2 3; do
    for site in $sites; do
      (( $(left) < 60 )) && return
      PYTHONPATH=$ROOT/$site:$ROOT/site stage "whole-$site-$round" 90 "$@" --out $RES/whole-$site-$round.json
    done
  done
}

stage() {  # stage NAME SECONDS COMMAND...: runs if time is left, bounded by its own limit
  local name=$1 limit=$2; shift 2
  local l=$(left)
  if (( l < 30 )); then echo "$(date +%T) skip $name (budget spent)" >> $RES/stages.txt; return; fi
  (( limit > l )) && limit=$l
  echo "$(date +%T) start $name (limit ${limit}s)" >> $RES/stages.txt
  timeout -k 5 $limit "$@" > $RES/$name.log 2>&1
  local rc=$?
  echo "$(date +%T) end $name rc=$rc after $(( $(date +%s) - START ))s" >> $RES/stages.txt
}

par() {  # par NAME SECONDS COMMAND...: a stage in the background, with its own kernel cache
  local name=$1; shift
  ( export MLX_PTX_CACHE_DIR=$ROOT/ptx-$name; stage "$name" "$@" ) &
}

merge_ptx() {  # after `wait`: one kernel cache from the parallel ones, for the timed runs
  mkdir -p $ROOT/ptx && for d in $ROOT/ptx-*; do cp -rn "$d"/. $ROOT/ptx/ 2>/dev/null; done
  export MLX_PTX_CACHE_DIR=$ROOT/ptx
}

verify_all() {  # verify_all NAME...: CUDA `verify` of each patch in parallel (one state folder and kernel
  # cache each, --report to $RES), then their records merged into $ROOT/state and the kernel caches into one
  for name in "$@"; do
    GLM53_PATCHES_STATE_DIR=$ROOT/state-$name par verify_$name ${VERIFY_LIMIT:-420} $PY -m glm53_patches.cli verify $name \
      --report $RES/verify_$name.json
  done
  wait
  merge_ptx
  $PY - "$ROOT" > $RES/verified_merge.txt 2>&1 <<'PY'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1]); merged = {}
for path in sorted(root.glob("state-*/verified.json")):
    merged.update(json.loads(path.read_text()))
(root / "state").mkdir(exist_ok=True)
(root / "state" / "verified.json").write_text(json.dumps(merged, indent=1, sort_keys=True))
for key, value in sorted(merged.items()):
    print(key.split("|")[0], key.split("|")[-1], "passed" if value.get("passed") else "FAILED", value.get("cases"), value.get("seconds"))
PY
}
