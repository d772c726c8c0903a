"""Why the stock server refuses a short chat request here ("Protected conversation exceeds the
available context budget"): the tiny model's prompt as the server counts it, the context limit it
derives, and the same request with and without automatic compaction (context_management: [])."""

import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from glm53_patches import warmup
from glm53_patches.tiny_model import write_tiny_model

work = Path(tempfile.mkdtemp(prefix="budget-"))
model = write_tiny_model(work / "model", quantize_bits=None)
import transformers  # noqa: E402

print("transformers", transformers.__version__, flush=True)
from mlx_vlm.utils import load, prepare_inputs  # noqa: E402
from mlx_vlm.prompt_utils import apply_chat_template  # noqa: E402
from mlx_vlm.server import compaction, generation  # noqa: E402

m, processor = load(str(model))
prompt = apply_chat_template(processor, m.config, [{"role": "user", "content": warmup.prompt_of(16)}])
raw = prepare_inputs(processor, prompts=prompt)
print("prompt", repr(prompt[:200]), "input_ids", getattr(raw["input_ids"], "shape", None), flush=True)
print("context limit", compaction._context_limit(m.config, required=False), "configured", generation.get_configured_context_limit(), flush=True)
server = warmup._Server(model, work / "server.log")
try:
    server.wait_ready(300)
    for extra in ({}, {"context_management": []}):
        body = {"model": str(model), "messages": [{"role": "user", "content": warmup.prompt_of(16)}], "max_tokens": 4, **extra}
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            print(extra, urllib.request.urlopen(req, timeout=600).read()[:300], flush=True)
        except Exception as exc:  # noqa: BLE001
            print(extra, "failed:", exc, getattr(exc, "read", lambda: b"")()[:300], flush=True)
finally:
    server.stop()
    print((work / "server.log").read_text()[-3000:])
sys.exit(0)
