#!/usr/bin/env bash
# Session 21, second machine: batched_experts (the MoE prefill as batched matmuls) in the
# numerics-changing set, on a fresh machine (no verify records: dequantized_experts forced on,
# verified exact on this H200 an hour before, s21). 45 layers, 4k, interleaved: the changing set
# of s21 (kda_prefill_kernel + latent_prefill + dequantized_experts) with and without
# batched_experts, stock as the check's untimed reference; then 32k; then the changing patches'
# quality gate on CUDA (tiny model, fp32 and bf16). Usage: h200-s22.sh BUDGET
BUDGET=${1:-600}
. "$(dirname "$0")/stages.sh"
export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1
A=kda_prefill_kernel+latent_prefill+dequantized_experts
stage quality_changing 120 $PY "$(dirname "$0")/quality_changing.py" --out $RES/quality_changing.json
stage prefill_4k_batched 420 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
  --prefill-untimed-stock --prefill-rounds 3 --no-png --arms stock,$A,$A+batched_experts --out $RES/prefill_4k_batched.json
stage prefill_32k_batched 200 $B --experts 64 --sections prefill --prefill 32768 --prefill-check-tokens 2048 \
  --prefill-untimed-stock --prefill-rounds 1 --no-png --arms stock,$A+batched_experts --out $RES/prefill_32k_batched.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
