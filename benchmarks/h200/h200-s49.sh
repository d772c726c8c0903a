#!/usr/bin/env bash
# The s49 device plan (issue 17): routed_experts' decode step with up and gate in one launch. Two calls on one
# machine; the caller tars /root/res into $OUT. /root/site holds the new wheel, /root/site0 main's before it.
# p: probe_expert_pair.py (one launch against two, bit for bit and timed), then the whole step once per package,
#    site0 then site, each process with arms A and A + exact_qmv + routed_experts (45 layers at real widths,
#    64 experts, bf16, 4,096 tokens, every kernel forced on): A is the same code in both, the machine's yardstick.
# v: CUDA `verify routed_experts` on the new code.
# Usage: h200-s49.sh p|v BUDGET
PART=$1
BUDGET=${2:-560}
HERE="$(dirname "$0")"
. "$HERE/stages.sh"
case $PART in
p)
  stage pair 150 $PY "$HERE/probe_expert_pair.py" --out $RES/probe_expert_pair.json
  force_kernels
  export GLM53_EXACT_QMV_KERNEL=1
  A=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode
  for site in site0 site; do
    limit=$(( ($(left) - 10) / $([ $site = site0 ] && echo 2 || echo 1) ))
    PYTHONPATH=$ROOT/$site:$ROOT/site stage decode-$site $limit \
      $B --layers 45 --experts 64 --sections decode --contexts 4096 --prefill '' \
      --arms $A,$A+exact_qmv+routed_experts --rounds ${ROUNDS:-3} --steps 24 --warmup 4 --check-steps 4 \
      --pipelined-steps 24 --budget-s $(( limit - 40 )) --no-png --out $RES/decode-$site.json
  done ;;
v)
  VERIFY_LIMIT=$(( $(left) - 15 )) verify_all routed_experts ;;
esac
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
