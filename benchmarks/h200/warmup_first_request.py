"""What `glm53-patches warmup` saves the server's first request: a 4-layer checkpoint at GLM-5.3-Flash's widths.

Writes the checkpoint (random weights, 4-bit, KDA and DSA layers, 16 experts,
top-8), runs ``glm53-patches warmup --model DIR`` into an empty kernel cache,
then starts the stock server on the same cache and times a first request
whose prompt differs from warmup's (another length, so another partial
chunk), the same request again (no compilation left: the compute alone), and
two concurrent ones. Which kernels MLX compiles does not depend on the layer
count, only on the shapes, so 4 layers compile what 45 do.

    python benchmarks/h200/warmup_first_request.py [--small] [--out F.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def real_overrides(layers=4, experts=16):
    from mlx_vlm.models.glm5_next.config import TextConfig

    from glm53_patches.tiny_model import tiny_config

    real = TextConfig()
    keep = ("max_position_embeddings", "pad_token_id", "eos_token_id", "dtype", "tie_word_embeddings",
            "num_hidden_layers", "layer_types", "index_topk_pattern", "mlp_layer_types", "first_k_dense_replace",
            "n_routed_experts")
    overrides = {k: getattr(real, k) for k in tiny_config()["text_config"] if hasattr(real, k) and k not in keep}
    L, D = "linear_attention", "deepseek_sparse_attention"
    overrides.update(num_hidden_layers=layers, layer_types=[L, D, L, D][:layers], index_topk_pattern="F" * layers,
                     mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), first_k_dense_replace=1,
                     n_routed_experts=experts, max_position_embeddings=8192)
    return overrides


def served_as_bf16(model):
    """Floats in bf16 as a converted checkpoint has them (the float32 paths glm5_next keeps stay float32)."""
    import mlx.core as mx

    from glm53_patches.bench.synthetic import FP32_MARKERS

    path = model / "model.safetensors"
    weights = mx.load(str(path))
    weights = {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 and not any(m in k for m in FP32_MARKERS) else v
               for k, v in weights.items()}
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config, indent=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="the tiny model's widths (a CPU dry run)")
    p.add_argument("--out")
    a = p.parse_args()
    from glm53_patches import warmup
    from glm53_patches.tiny_model import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="warmup-ttft-"))
    result = {"small": a.small}
    started = time.perf_counter()
    model = write_tiny_model(work / "model", quantize_bits=4, **({} if a.small else real_overrides()))
    if not a.small:
        served_as_bf16(model)
    result["build_s"] = time.perf_counter() - started
    env = dict(os.environ, HF_HUB_OFFLINE="1", MLX_PTX_CACHE_DIR=str(work / "ptx"))
    os.environ.update(env)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "glm53_patches.cli", "warmup", "--model", str(model)],
                          env=env, capture_output=True, text=True)
    result.update(warmup_s=time.perf_counter() - started, warmup_rc=done.returncode,
                  warmup_stdout=done.stdout, warmup_stderr=done.stderr[-3000:])
    print(done.stderr, done.stdout, flush=True)
    server = warmup._Server(model, work / "server.log")
    try:
        server.wait_ready(900)
        files = warmup._files(work / "ptx")
        # The tiny tokenizer makes "note " three tokens: 960 words are about 2,900 tokens, a full
        # 2,048 chunk and a partial one other than warmup's (2,900 words were 8,716 tokens, past the
        # checkpoint's 8,192 positions: the server refused them, s19).
        words = 300 if a.small else 960
        for label in ("first", "again"):
            started = time.perf_counter()
            usage = server.chat(warmup.prompt_of(words), 16)
            result[f"{label}_s"] = time.perf_counter() - started
            result[f"{label}_tokens"] = usage
            print(label, result[f"{label}_s"], usage, flush=True)
        started = time.perf_counter()
        threads = [threading.Thread(target=server.chat, args=(warmup.prompt_of(40 + 9 * i), 32)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        result["concurrent_s"] = time.perf_counter() - started
        result["new_kernel_files_during_requests"] = warmup._files(work / "ptx") - files
    finally:
        server.stop()
    result["first_minus_again_s"] = result["first_s"] - result["again_s"]
    print(json.dumps({k: v for k, v in result.items() if "std" not in k}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
