#!/usr/bin/env bash
# Next session's plan (not yet run), five foreground calls of one machine, each tarring /root/res
# to $OUT itself (the machine is released 30 s after a call):
#   part 1: CUDA verify, in parallel, of the exact prefill patches whose digests changed after s30
#           (exact_kda_prefill, exact_sparse_prefill, dequantized_linear, dequantized_experts,
#           gathered_prefill: `prefill_only` declared in their __init__); dequantized_linear alone took
#           487 s cold in s30, hence the longer limit; records merged into /root/state. Beside them, the
#           changing patches' quality gate on CUDA (s25's stopped after 5 of 8 rows). Then what a
#           hyper-connection costs at prefill and what hc_decode's kernel would save there;
#   part d: CUDA verify of the decode patches whose digests changed (hc_decode, expert_combine,
#           router_select, dsa_decode: they now take speculative verify blocks; layer_decode; exact_qmv:
#           its verify takes gpu_widths from tiny_model now);
#   part 2: the 45-layer 4k prefill, 2 interleaved rounds, stock the untimed reference: the exact set
#           with its kernels on (by their records) without and with dequantized_linear (never run
#           together), and the changing set without and with it (s30 measured dequantized_linear's
#           first version there); then where a chunk of the fastest set goes;
#   part 3: dequantized_linear at every 64th row count from its threshold to 4,096 (verify checks five),
#           then s29's decode comparison (exact_qmv at 5 rounds), if the budget allows;
#   part 4: speculative verify blocks (issue 16): blocks of 1-4 tokens at 256 and 4,096 tokens of
#           context, stock against the exact decode set with and without layer_decode, every block
#           checked bit for bit (kernels forced on, so it does not need part d's records).
# Parts d and 4 ran on 2026-12-05 (BENCHMARKS.md, results 2026-12-05-h200-s31-*); 1, 2 and 3 are left.
# Usage: h200-s31.sh PART BUDGET
PART=${1:-1}
BUDGET=${2:-560}
. "$(dirname "$0")/stages.sh"
if [ "$PART" = 1 ]; then
  par quality_changing 500 $PY "$(dirname "$0")/quality_changing.py" --out $RES/quality_changing.json  # s25's stopped at 180 s
  VERIFY_LIMIT=520 verify_all ${VERIFY:-exact_kda_prefill exact_sparse_prefill dequantized_linear dequantized_experts gathered_prefill}
  stage micro_hc_prefill 60 $PY "$(dirname "$0")/micro_hc_prefill.py" --out $RES/micro_hc_prefill.json
elif [ "$PART" = 2 ]; then
  merge_ptx
  export GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1
  E=exact_kda_prefill+exact_sparse_prefill+dequantized_experts
  C=kda_prefill_kernel+latent_prefill+dequantized_experts+batched_experts
  stage prefill_4k 420 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
    --prefill-untimed-stock --prefill-rounds 2 --no-png --arms stock,$E,$E+dequantized_linear,$C,$C+dequantized_linear \
    --out $RES/prefill_4k.json
  stage profile_fastest 120 $PY "$(dirname "$0")/profile_prefill_chunk.py" --context 4096 --experts 64 \
    --patches kda_prefill_kernel,latent_prefill,dequantized_experts,batched_experts,dequantized_linear \
    --out $RES/profile_fastest.json
elif [ "$PART" = d ]; then
  VERIFY_LIMIT=520 verify_all ${VERIFY:-hc_decode layer_decode router_select expert_combine dsa_decode exact_qmv}
elif [ "$PART" = 4 ]; then
  # Kernels forced on: the bench checks every block against stock bit for bit, records or not.
  export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
    GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode
  stage verify_blocks $(( $(left) - 20 )) $B --layers 45 --experts 64 --sections verify --contexts 256,4096 \
    --prefill '' --verify-blocks 1,2,3,4 --arms stock,$D,$D+layer_decode --rounds 3 --steps 6 --warmup 2 \
    --check-steps 2 --budget-s $(( $(left) - 40 )) --no-png --out $RES/verify_blocks.json
else
  merge_ptx
  stage probe_dense_rows 150 $PY "$(dirname "$0")/probe_dense_rows.py" --out $RES/probe_dense_rows.json
  export GLM53_HC_DECODE_KERNEL=1 GLM53_FUSED_KDA_KERNEL_KERNEL=1 GLM53_ROUTER_SELECT_KERNEL=1 \
    GLM53_EXPERT_COMBINE_KERNEL=1 GLM53_DSA_DECODE_KERNEL=1
  D=compiled_kda_decode+fused_kda_kernel+hc_decode+router_select+expert_combine+dsa_decode+layer_decode
  stage decode $(( $(left) - 20 )) $B --layers 45 --experts 64 --sections decode --contexts 256,4096 \
    --prefill '' --arms stock,$D,$D+exact_qmv --rounds 5 --steps 16 --warmup 4 --check-steps 8 --pipelined-steps 16 \
    --budget-s $(( $(left) - 40 )) --no-png --out $RES/decode.json
fi
echo "$(date +%T) part $PART done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
