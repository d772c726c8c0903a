#!/usr/bin/env bash
# Twelfth session (issue 18): where stock's DSA sparse prefill attention goes and what
# exact_sparse_prefill makes of it (probe, alone on the GPU); then CUDA verify of
# exact_sparse_prefill and layer_decode (its COMPOSES changed) in parallel, beside
# warmup_first_request (the server's wheels carried this time; timings there share the
# GPU and CPU with the verifies); then the 45-layer 4k prefill, stock vs
# E = exact_kda_prefill + dequantized_experts vs E + exact_sparse_prefill, 2 interleaved
# rounds after the check pass (every arm bit for bit against stock on the first 2,048
# tokens). The fast paths are forced on (their knobs) so the timed arms need no record.
# Start it detached (setsid) and collect /root/res in later calls. Usage: h200-s19.sh BUDGET
BUDGET=${1:-1300}
. "$(dirname "$0")/stages.sh"
( export MLX_PTX_CACHE_DIR=$ROOT/ptx-probe
  stage probe_sparse 300 $PY "$(dirname "$0")/probe_sparse_prefill.py" --out $RES/probe_sparse.json )
( export MLX_PTX_CACHE_DIR=$ROOT/ptx-warmup
  stage warmup_first_request 400 $PY "$(dirname "$0")/warmup_first_request.py" --out $RES/warmup_first_request.json ) &
verify_all exact_sparse_prefill layer_decode
export GLM53_EXACT_KDA_PREFILL_KERNEL=1 GLM53_DEQUANTIZED_EXPERTS_FAST_PATH=1 GLM53_EXACT_SPARSE_PREFILL_KERNEL=1
E=exact_kda_prefill+dequantized_experts
stage prefill_model 700 $B --experts 64 --sections prefill --prefill 4096 --prefill-check-tokens 2048 \
  --prefill-rounds 2 --no-png --arms stock,$E,$E+exact_sparse_prefill --out $RES/prefill_model.json
echo "$(date +%T) done after $(( $(date +%s) - START ))s" >> $RES/stages.txt
