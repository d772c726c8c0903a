#!/usr/bin/env bash
# Session 30's plan, two foreground calls of one machine (each tars /root/res to $OUT itself):
#   part 1: CUDA verify of dequantized_linear (new), and of what s28 left owed: layer_decode (its digest
#           changed when it began composing exact_qmv), exact_qmv, dequantized_experts (the 288-expert
#           split), in parallel, records merged into /root/state; then dequantized_linear per projection;
#   part 2: the 45-layer prefill of 4,096 tokens, 2 interleaved rounds, stock the check's untimed
#           reference: the exact prefill set and the changing one (with batched_experts, s25's 1,797
#           tok/s), each without and with dequantized_linear. Both dequantized patches forced on, so a
#           failed verify shows as a failed check, not as a silent stock path.
# Usage: h200-s30.sh PART BUDGET
PART=${1:-1}
BUDGET=${2:-560}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = 1 ]; then
  verify_all dequantized_linear layer_decode exact_qmv dequantized_experts
  stage micro_dense_prefill 120 $PY "$(dirname "$0")/micro_dense_prefill.py" --out $RES/micro_dense_prefill.json
else
  merge_ptx
  export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1 GLM53_DEQUANTIZED_LINEAR_FAST_PATH=1
  E=exact_kda_prefill+exact_sparse_prefill+dequantized_experts
  C=kda_prefill_kernel+latent_prefill+dequantized_experts+batched_experts
  stage prefill_4k $(( BUDGET - 20 )) $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
    --prefill-untimed-stock --prefill-rounds 2 --no-png --arms stock,$E,$E+dequantized_linear,$C,$C+dequantized_linear \
    --out $RES/prefill_4k.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
# What ran (s30): parts 1 and 2 as above; dequantized_linear's verify hit its 420 s limit in part 1
# (a cold compile shared with three others). Part 3, inline in the same machine's next call: the
# changing set without and with dequantized_linear, 3 rounds (prefill_4k_c), then its verify alone,
# which failed (split-K below 1,024 rows, narrow outputs; PATCH.md). After the envelope was added,
# a fresh machine ran `glm53-patches verify dequantized_linear` alone: passed, 72 cases, 487 s.
