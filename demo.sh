#!/usr/bin/env bash
# Fresh machine to a patched stock server: venv, install, tiny model, serve, one request.
#   bash demo.sh          keep serving after the first answer (Ctrl-C stops)
#   bash demo.sh --once   stop after the first answer
# The port is $PORT if set (it must be free), else 8080 if free, else any free one.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
. .venv/bin/activate
extra=$([[ "$(uname)" == Linux ]] && echo "[cpu]" || echo "")  # Linux needs mlx's CPU backend; Macs get Metal
python -m pip install --quiet -e ".$extra"
free_port() {  # prints a free port: $1 if given (or fails), else 8080 if free, else one the OS picks
  python - "$@" <<'PY'
import socket, sys
def free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
        return s.getsockname()[1]
if len(sys.argv) > 1:
    port = free(int(sys.argv[1]))
    if port is None:
        sys.exit(f"demo.sh: port {sys.argv[1]} is in use; set PORT to a free port, or unset it")
else:
    port = free(8080) or free(0)
print(port)
PY
}
PORT=$(free_port ${PORT:+"$PORT"})
model="${TINY_MODEL_DIR:-$PWD/out/tiny-glm5-next-q4}"
glm53-patches tiny-model "$model" --quantize-bits 4 >/dev/null

export HF_HUB_OFFLINE=1 GLM53_PATCHES="${GLM53_PATCHES:-all}"
# mlx-vlm's prefix cache with its disk tier, which vault_cache makes safe to persist
export APC_ENABLED="${APC_ENABLED:-1}" APC_DISK_PATH="${APC_DISK_PATH:-$PWD/out/apc}"
mkdir -p out && log="$PWD/out/demo-server.log"
python -m mlx_vlm.server --model "$model" --host 127.0.0.1 --port "$PORT" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
echo "server (pid $server) on port $PORT; its log: $log"
python - "$PORT" "$model" "$server" "$log" <<'PY'
import json, os, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(480):
    try:
        os.kill(int(sys.argv[3]), 0)  # our server, not whatever else listens there
    except ProcessLookupError:
        sys.exit("demo.sh: the server exited before it answered; the end of its log:\n"
                 + open(sys.argv[4]).read()[-2000:])
    try:
        urllib.request.urlopen(url + "/v1/models", timeout=2); break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit(f"demo.sh: the server did not answer within 4 minutes (log: {sys.argv[4]})")
body = {"model": sys.argv[2], "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello from glm53-patches!"}]}
req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
for attempt in ("cold", "warm"):
    reply = json.load(urllib.request.urlopen(req, timeout=120))
    cached = reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    print(f"{attempt} answer: {reply['choices'][0]['message']['content']!r} (cached prompt tokens: {cached})")
print("(the tiny model has random weights, so its answers are gibberish by design: what matters is that the\n"
      " patched server gives exactly stock's answer, which tests/server checks, and the hits below)")
PY
sleep 1.5  # let the server publish its hit counters
glm53-patches status
if [[ "${1:-}" != "--once" ]]; then
  echo "serving on http://127.0.0.1:$PORT (Ctrl-C to stop)"
  wait $server
fi
