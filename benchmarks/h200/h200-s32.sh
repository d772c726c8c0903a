#!/usr/bin/env bash
# Session 32's plan, two foreground calls of one machine, each tarring /root/res to $OUT itself:
#   part b: speculative verify blocks (issue 16) now that layer_decode and dsa_decode's indexer take
#           them: s31 part 4's command (blocks of 1-4 tokens at 256 and 4,096 tokens of context, stock
#           against the exact decode set with and without layer_decode, every block checked bit for
#           bit, kernels forced on), so the two runs compare; the table now also gives each block's
#           graph-build ms;
#   part v: CUDA verify, in parallel, of layer_decode (its code now takes verify blocks; its verify
#           runs them), dsa_decode (its indexer now takes blocks) and of the five prefill patches whose
#           records s31 owed (exact_kda_prefill, exact_sparse_prefill, dequantized_linear,
#           dequantized_experts, gathered_prefill).
# Ran on 2026-12-05 (BENCHMARKS.md, results 2026-12-05-h200-s32-*): part b on a cold machine stopped
# at its limit inside 256/4 (the checks compiled kernels for 218 s); the 4,096 context, 256 at
# L = 1 and 4, and the verifies of layer_decode, dsa_decode, exact_sparse_prefill and
# gathered_prefill then ran as single commands on the warm machine. exact_kda_prefill did not finish
# within its 125 s; dequantized_linear and dequantized_experts were not run.
# Usage: h200-s32.sh PART BUDGET
PART=${1:-b}
BUDGET=${2:-560}
if [ "$PART" = b ]; then
  exec bash "$(dirname "$0")/h200-s31.sh" 4 "$BUDGET"
fi
. "$(dirname "$0")/stages.sh"
VERIFY_LIMIT=$(( $(left) - 30 )) verify_all ${VERIFY:-layer_decode dsa_decode exact_kda_prefill exact_sparse_prefill \
  dequantized_linear dequantized_experts gathered_prefill}
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
