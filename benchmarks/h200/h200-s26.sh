#!/usr/bin/env bash
# Next session's plan (not yet run): dequantized_experts' split for 288 experts on CUDA.
# Two parts, each short enough to run in the foreground of one device call, with /root/res tarred
# to $OUT by that same call (s24 lost its files to a poll that came after the machine went back).
#   part 1: the split's micro-benchmark at 288 experts, then CUDA verify of dequantized_experts
#           (16 cases: the 288-expert split as served, and forced with a short last range);
#   part 2, in the next call at once (the verify record lives in /root/state): the 45-layer 4k
#           prefill, stock vs `all` (64 experts: no split; the verified path still runs there).
# Usage: h200-s26.sh PART BUDGET
PART=${1:-1}
BUDGET=${2:-540}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = 1 ]; then
  stage micro_split_experts 100 $PY "$(dirname "$0")/micro_split_experts.py" --out $RES/micro_split_experts.json
  verify_all dequantized_experts
else
  stage prefill_4k_exact 520 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
    --prefill-untimed-stock --prefill-rounds 2 --no-png --arms stock,all --out $RES/prefill_4k_exact.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
