#!/usr/bin/env bash
# Fresh machine to a patched stock server: venv, install, tiny model, serve, one request.
#   bash demo.sh          keep serving on :8080 after the first answer (Ctrl-C stops)
#   bash demo.sh --once   stop after the first answer
set -euo pipefail
cd "$(dirname "$0")"
PORT="${PORT:-8080}"
python3 -m venv .venv
. .venv/bin/activate
backend=$([[ "$(uname)" == Linux ]] && echo "mlx[cpu]" || echo mlx)  # Macs get Metal
python -m pip install --quiet "$backend" -e .
model="${TINY_MODEL_DIR:-$PWD/out/tiny-glm5-next-q4}"
glm53-patches tiny-model "$model" --quantize-bits 4 >/dev/null

export HF_HUB_OFFLINE=1 GLM53_PATCHES="${GLM53_PATCHES:-all}"
# mlx-vlm's prefix cache with its disk tier, which vault_cache makes safe to persist
export APC_ENABLED="${APC_ENABLED:-1}" APC_DISK_PATH="${APC_DISK_PATH:-$PWD/out/apc}"
python -m mlx_vlm.server --model "$model" --host 127.0.0.1 --port "$PORT" &
server=$!
trap 'kill $server 2>/dev/null' EXIT
python - "$PORT" "$model" <<'PY'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(240):
    try:
        urllib.request.urlopen(url + "/v1/models", timeout=2); break
    except OSError:
        time.sleep(0.5)
body = {"model": sys.argv[2], "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello from glm53-patches!"}]}
req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
for attempt in ("cold", "warm"):
    reply = json.load(urllib.request.urlopen(req, timeout=120))
    cached = reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    print(f"{attempt} answer: {reply['choices'][0]['message']['content']!r} (cached prompt tokens: {cached})")
PY
sleep 1.5  # let the server publish its hit counters
glm53-patches status
if [[ "${1:-}" != "--once" ]]; then
  echo "serving on http://127.0.0.1:$PORT (Ctrl-C to stop)"
  wait $server
fi
