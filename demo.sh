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
reply = json.load(urllib.request.urlopen(req, timeout=120))
print("answer:", repr(reply["choices"][0]["message"]["content"]))
PY
sleep 1.5  # let the server publish its hit counters
glm53-patches status
if [[ "${1:-}" != "--once" ]]; then
  echo "serving on http://127.0.0.1:$PORT (Ctrl-C to stop)"
  wait $server
fi
