#!/usr/bin/env bash
# Session 21's plan. Issue 18's open figures, on the committed code:
# 1. CUDA verify of the prefill patches whose code digests changed (exact_kda_prefill and
#    exact_sparse_prefill gained their stage files) and of dequantized_experts, in parallel, records
#    merged into $ROOT/state; their kernel caches, merged, warm the bench. Beside them, on its own
#    empty cache, warmup_first_request: `glm53-patches warmup`, then the server's first request
#    (timed while the verifies still run: an upper bound);
# 2. 45 layers, 4k: stock vs `all` (what GLM53_PATCHES=all admits after those verifies: the exact
#    prefill set) vs `all` + the numerics-changing kda_prefill_kernel and latent_prefill (now dense);
# 3. 45 layers, 32k: `all` and the numerics-changing set, stock only as the check's untimed
#    reference (first 2,048 tokens);
# 4. where the last 2,048 tokens of a 4k prompt go, per module, in the exact and the changing set.
# Start it detached (setsid) and collect /root/res in later calls. Usage: h200-s21.sh BUDGET
BUDGET=${1:-1500}
. "$(dirname "$0")/stages.sh"
par warmup_first_request 600 $PY "$(dirname "$0")/warmup_first_request.py" --out $RES/warmup_first_request.json
verify_all exact_kda_prefill exact_sparse_prefill dequantized_experts
CHANGING=all+kda_prefill_kernel+latent_prefill
stage prefill_4k 500 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
  --prefill-rounds 2 --no-png --arms stock,all,$CHANGING --out $RES/prefill_4k.json
stage prefill_32k 400 $B --experts 64 --sections prefill --prefill 32768 --prefill-check-tokens 2048 \
  --prefill-untimed-stock --prefill-rounds 1 --no-png --arms stock,all,$CHANGING --out $RES/prefill_32k.json
stage profile_exact 150 $PY "$(dirname "$0")/profile_prefill_chunk.py" --context 4096 --experts 64 \
  --patches exact_kda_prefill,exact_sparse_prefill,dequantized_experts --out $RES/profile_exact.json
stage profile_changing 150 $PY "$(dirname "$0")/profile_prefill_chunk.py" --context 4096 --experts 64 \
  --patches kda_prefill_kernel,latent_prefill,dequantized_experts --out $RES/profile_changing.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
