#!/usr/bin/env bash
# Next session's plan (not yet run): dequantized_experts' split for 288 experts on CUDA.
# 1. CUDA verify of dequantized_experts (16 cases: the 288-expert split as served, and forced with a
#    short last range, against gather_qmm) beside the split's micro-benchmark at 288 experts;
# 2. the 45-layer 4k prefill, exact set, with the new record (64 experts: no split; a check that
#    the verified path still runs there). Usage: h200-s26.sh BUDGET
BUDGET=${1:-900}
. "$(dirname "$0")/stages.sh"
stage micro_split_experts 120 $PY "$(dirname "$0")/micro_split_experts.py" --out $RES/micro_split_experts.json
verify_all dequantized_experts
stage prefill_4k_exact 420 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
  --prefill-untimed-stock --prefill-rounds 2 --no-png --arms stock,all --out $RES/prefill_4k_exact.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
