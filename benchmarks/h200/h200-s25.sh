#!/usr/bin/env bash
# Session 25's plan: s24 again after the machine was lost between polls (its micro-benchmark did
# finish: stock's SwitchGLU gave 29.3M NaNs at 288 experts, BatchedExperts none).
# 1. 45 layers, 4k, interleaved, 3 rounds: the changing set with and without batched_experts
#    (dequantized_experts forced on: a fresh machine has no verify record; it passed on the
#    H200 on 2026-12-03), stock as the check's untimed reference;
# 2. where a chunk goes with batched_experts;
# 3. untimed, side by side: which of MLX's CUDA gather_mm / gather_qmm paths give NaN at
#    which expert counts, and the changing patches' teacher-forced gate on CUDA.
# Usage: h200-s25.sh BUDGET
BUDGET=${1:-1250}
. "$(dirname "$0")/stages.sh"
export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1
A=kda_prefill_kernel+latent_prefill+dequantized_experts
stage prefill_4k_batched 480 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
  --prefill-untimed-stock --prefill-rounds 3 --no-png --arms stock,$A,$A+batched_experts --out $RES/prefill_4k_batched.json
stage profile_batched 150 $PY "$(dirname "$0")/profile_prefill_chunk.py" --context 4096 --experts 64 \
  --patches kda_prefill_kernel,latent_prefill,dequantized_experts,batched_experts --out $RES/profile_batched.json
par probe_gather_mm_nan 300 $PY "$(dirname "$0")/probe_gather_mm_nan.py" --out $RES/probe_gather_mm_nan.json
par quality_changing 400 $PY "$(dirname "$0")/quality_changing.py" --out $RES/quality_changing.json
wait
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
