#!/usr/bin/env bash
# Next session's plan (not yet run). Issue 18's open figures, on the committed code:
# 1. CUDA verify of the prefill patches whose code digests changed (exact_kda_prefill and
#    exact_sparse_prefill gained their stage files) and of dequantized_experts, in parallel, records
#    merged into $ROOT/state; their kernel caches, merged, warm the bench;
# 2. 45 layers, 4k: stock vs `all` (what GLM53_PATCHES=all admits after those verifies: the exact
#    prefill set) vs `all` + the numerics-changing kda_prefill_kernel and latent_prefill;
# 3. 45 layers, 32k: `all`, stock only as the check's untimed reference (first 2,048 tokens);
# 4. warmup_first_request: `glm53-patches warmup` into an empty cache, then the server's first request.
# Start it detached (setsid) and collect /root/res in later calls. Usage: h200-s21.sh BUDGET
BUDGET=${1:-1500}
. "$(dirname "$0")/stages.sh"
verify_all exact_kda_prefill exact_sparse_prefill dequantized_experts
stage prefill_4k 600 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
  --prefill-rounds 2 --no-png --arms stock,all,all+kda_prefill_kernel+latent_prefill --out $RES/prefill_4k.json
stage prefill_32k 420 $B --experts 64 --sections prefill --prefill 32768 --prefill-check-tokens 2048 \
  --prefill-untimed-stock --prefill-rounds 1 --no-png --arms stock,all --out $RES/prefill_32k.json
stage warmup_first_request 500 $PY "$(dirname "$0")/warmup_first_request.py" --out $RES/warmup_first_request.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
