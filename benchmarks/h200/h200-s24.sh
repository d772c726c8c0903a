#!/usr/bin/env bash
# Next session's plan (not yet run): batched_experts as fixed after s22, and the NaN at 288 experts.
# 1. the micro-benchmark again, now counting each side's NaNs at 64 and 288 experts;
# 2. 45 layers, 4k, interleaved, 3 rounds: the changing set with and without batched_experts
#    (dequantized_experts forced on: a fresh machine has no verify record; it passed on the
#    H200 on 2026-12-03), stock as the check's untimed reference;
# 3. where a chunk goes with batched_experts (its MoE block per layer);
# 4. the changing patches' teacher-forced gate on CUDA (it ran out of its 120 s in s22 before
#    printing anything: give it more). Usage: h200-s24.sh BUDGET
BUDGET=${1:-1300}
. "$(dirname "$0")/stages.sh"
export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1
A=kda_prefill_kernel+latent_prefill+dequantized_experts
stage micro_batched_experts 120 $PY "$(dirname "$0")/micro_batched_experts.py" --experts 64,288 \
  --out $RES/micro_batched_experts.json
stage prefill_4k_batched 480 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
  --prefill-untimed-stock --prefill-rounds 3 --no-png --arms stock,$A,$A+batched_experts --out $RES/prefill_4k_batched.json
stage profile_batched 150 $PY "$(dirname "$0")/profile_prefill_chunk.py" --context 4096 --experts 64 \
  --patches kda_prefill_kernel,latent_prefill,dequantized_experts,batched_experts --out $RES/profile_batched.json
stage quality_changing 400 $PY "$(dirname "$0")/quality_changing.py" --out $RES/quality_changing.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
