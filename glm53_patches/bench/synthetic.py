"""A synthetic GLM-5.3-Flash: random weights at real (or small) widths, quantized.

Weights are generated directly in their quantized form (random packed codes,
scales and biases), one layer at a time, so building never holds an fp32 copy
of the model. Recipe (as the stock baseline): routed experts 4-bit, KDA
projections 8-bit, every other Linear / MultiLinear / embedding / lm_head
6-bit, affine, group 64; router, hyper-connections, norms, conv, A_log,
dt_bias and index_kpool_compress stay unquantized (router, HC, A_log, dt_bias,
score bias and index_kpool_compress in fp32, the rest in the model dtype).

Decode at a context of C tokens starts from caches filled with random data of
the shapes and dtypes a C-token prefill leaves (DSA latent and indexer caches,
pooled indexer keys; KDA conv and recurrent state), so long contexts cost no
prefill.
"""

import math
import os
import zlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

GROUP = 64
BITS = {"expert": 4, "kda": 8, "other": 6}
KDA_PROJECTIONS = ("qkv_proj", "fbg_a_proj", "f_b_proj", "g_b_proj", "o_proj")
FP32_MARKERS = ("A_log", "dt_bias", "e_score_correction_bias", "attn_hc", "ffn_hc",
                "index_kpool_compress", "mlp.gate.weight")
REAL_EXPERTS = 288  # TextConfig default

# The small preset: every layer kind at tiny widths (runs on a laptop CPU).
SMALL = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8,
    num_experts_per_tok=2, index_n_heads=4, index_head_dim=64, index_topk=64, index_kpool=4,
    linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4},
    max_position_embeddings=4096,
)


def text_config(preset="real", layers=None, experts=None, **overrides):
    from mlx_vlm.models.glm5_next.config import TextConfig

    args = dict(SMALL) if preset == "small" else {}
    if layers:
        args["num_hidden_layers"] = layers
    if experts:
        args["n_routed_experts"] = experts
    args.update(overrides)
    return TextConfig(**args)


def available_memory():
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def auto_experts(config, dtype_bytes=2, fraction=0.6, cap=64):
    """The largest power of two of experts (top_k .. cap) whose weights fit the machine."""
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * _bytes_per_param(4, dtype_bytes)
    moe_layers = config.mlp_layer_types.count("sparse")
    rest = 1.2 * 13e9 * config.num_hidden_layers / 45 * config.hidden_size / 4096
    budget = fraction * available_memory() - rest
    experts = cap
    while experts > config.num_experts_per_tok and moe_layers * experts * per_expert > budget:
        experts //= 2
    return max(experts, config.num_experts_per_tok)


def _bytes_per_param(bits, scale_bytes):
    return bits / 8 + 2 * scale_bytes / GROUP


def _bits_for(config, path, module):
    if not hasattr(module, "to_quantized") or module.weight.shape[-1] % GROUP:
        return None
    if ".switch_mlp." in path:
        return BITS["expert"]
    parts = path.split(".")
    if "layers" in parts and parts[-1] in KDA_PROJECTIONS and parts[-2] == "self_attn":
        layer = int(parts[parts.index("layers") + 1])
        if config.layer_types[layer] == "linear_attention":
            return BITS["kda"]
    return BITS["other"]


def _key(seed, path):
    return mx.random.key((seed * 1000003 + zlib.crc32(path.encode())) % (1 << 31))


def _float_init(path, shape, key, dtype):
    *owner, leaf = path.split(".")
    module = owner[-1] if owner else ""
    normal = lambda std: std * mx.random.normal(shape, key=key)  # noqa: E731
    uniform = lambda lo, hi: mx.random.uniform(lo, hi, shape, key=key)  # noqa: E731
    if leaf == "A_log":
        value = uniform(0.0, math.log(4.0))
    elif leaf == "dt_bias":
        value = uniform(-4.0, -1.0)
    elif leaf == "e_score_correction_bias":
        value = normal(0.05)
    elif leaf == "index_kpool_compress_ape":
        value = normal(0.5)
    elif module.endswith("_hc") and leaf == "base":
        value = normal(0.5)
    elif module.endswith("_hc") and leaf == "scale":
        value = uniform(0.5, 1.5)
    elif "norm" in module:
        value = 1.0 + normal(0.1) if leaf == "weight" else normal(0.01)
    elif leaf == "bias":
        value = mx.zeros(shape)
    elif "conv" in module:
        value = normal(1.0 / math.sqrt(math.prod(shape[1:])))
    else:  # router, HC fn, index gate: [.., in]
        value = normal(1.0 / math.sqrt(shape[-1]))
    keep32 = any(marker in path for marker in FP32_MARKERS)
    return value.astype(mx.float32 if keep32 else dtype)


def _quantized_init(module, key, dtype):
    """Random packed codes with scales so the dequantized weight has std 1/sqrt(in)."""
    weight = module.weight
    levels = (1 << module.bits) - 1
    in_dims = weight.shape[-1] * 32 // module.bits
    std = 1.0 if isinstance(module, nn.QuantizedEmbedding) else 1.0 / math.sqrt(in_dims)
    k1, k2 = mx.random.split(key)
    codes = mx.random.randint(0, 256, (*weight.shape[:-1], weight.shape[-1] * 4), dtype=mx.uint8, key=k1)
    scales = std * math.sqrt(12.0) / levels * mx.random.uniform(0.75, 1.25, module.scales.shape, key=k2)
    scales = scales.astype(dtype)
    out = {"weight": codes.view(mx.uint32), "scales": scales}
    if module.get("biases") is not None:
        out["biases"] = (-scales.astype(mx.float32) * (levels / 2)).astype(dtype)
    return out


def _fill(root, prefix, config, dtype, seed):
    """Replace every array under ``root`` by generated values; evaluate them."""
    quantized = {}
    for path, module in root.named_modules():
        if hasattr(module, "bits") and "scales" in module:
            full = f"{prefix}.{path}" if path else prefix
            quantized[path] = _quantized_init(module, _key(seed, full), dtype)
    updates = []
    for path, value in tree_flatten(root.parameters()):
        owner, _, leaf = path.rpartition(".")
        if owner in quantized and leaf in quantized[owner]:
            updates.append((path, quantized[owner][leaf]))
        else:
            full = f"{prefix}.{path}"
            updates.append((path, _float_init(full, value.shape, _key(seed, full), dtype)))
    root.update(tree_unflatten(updates))
    mx.eval(root.parameters())


def build(config, dtype=mx.bfloat16, seed=0, progress=None):
    """The LanguageModel with random quantized weights, built layer by layer."""
    from ..upstream_import import import_language

    language = import_language()
    model = language.LanguageModel(config)
    nn.quantize(
        model,
        class_predicate=lambda p, m: (lambda b: {"group_size": GROUP, "bits": b, "mode": "affine"} if b else False)(
            _bits_for(config, p, m)
        ),
    )
    model.eval()  # after quantizing, as mlx-vlm's load_model: new Quantized* modules start in training mode
    parts = [("model.embed_tokens", model.model.embed_tokens), ("model.norm", model.model.norm)]
    if not config.tie_word_embeddings:
        parts.append(("lm_head", model.lm_head))
    parts += [(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)]
    for n, (prefix, module) in enumerate(parts):
        _fill(module, prefix, config, dtype, seed)
        if progress and (n % 5 == 4 or n == len(parts) - 1):
            progress(f"built {n + 1}/{len(parts)} parts, {mx.get_active_memory() / 1e9:.2f} GB")
    return model


# -- bytes a decode token reads ---------------------------------------------------------


def decode_bytes(model, config):
    """Weight bytes one decode token reads, by category: every non-expert weight,
    top_k of the routed experts per MoE layer, one embedding row."""
    top_k, experts = config.num_experts_per_tok, config.n_routed_experts
    out = {}
    router = 0
    for path, value in tree_flatten(model.parameters()):
        size = value.nbytes
        parts = path.split(".")
        layer = int(parts[2]) if parts[:2] == ["model", "layers"] else None
        if path.startswith("model.embed_tokens"):
            category, size = "embedding (1 row)", size / config.vocab_size
        elif path.startswith("lm_head"):
            category = "lm_head"
        elif ".switch_mlp." in path:
            category, size = "routed experts (top_k)", size * top_k / experts
        elif ".mlp.shared_experts." in path:
            category = "shared experts"
        elif ".mlp.gate." in path:
            category = "router"
            router += size
        elif ".mlp." in path:
            category = "dense MLP"
        elif "_hc." in path:
            category = "hyper-connections"
        elif ".self_attn." in path:
            kind = config.layer_types[layer]
            category = "KDA attention" if kind == "linear_attention" else "DSA attention"
        else:
            category = "norms"
        out[category] = out.get(category, 0) + size
    total = sum(out.values())
    real = total + router * (REAL_EXPERTS / experts - 1) if _is_real_width(config) else total
    return {"total": total, "by_category": dict(sorted(out.items(), key=lambda kv: -kv[1])),
            "total_with_288_experts": real}


def _is_real_width(config):
    from mlx_vlm.models.glm5_next.config import TextConfig

    ref = TextConfig()
    keys = ("hidden_size", "moe_intermediate_size", "vocab_size", "linear_num_heads", "q_lora_rank")
    return all(getattr(config, k) == getattr(ref, k) for k in keys)


# -- caches at a context length ----------------------------------------------------------


def context_caches(model, context, dtype, spare=512, seed=0):
    """Caches of every layer as a ``context``-token prefill leaves them, filled with
    random data; built directly (no model call: a decode step from empty caches is
    not a path real generation takes, and it crashed MLX's CUDA backend)."""
    c = model.config
    caches = model.make_cache()
    capacity = -(-(context + spare) // 256) * 256
    key = mx.random.key(seed + 7)
    normal = lambda shape, std, dt: (std * mx.random.normal(shape, key=next_key())).astype(dt)  # noqa: E731
    keys = iter(mx.random.split(key, 8 * len(caches)))
    next_key = lambda: next(keys)  # noqa: E731
    for layer, cache in zip(model.model.layers, caches):
        if layer.is_linear:
            channels = 3 * c.linear_num_heads * c.linear_head_dim
            cache[0] = normal((1, c.linear_conv_kernel_dim - 1, channels), 0.5, dtype)
            cache[1] = normal((1, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim), 0.05, mx.float32)
            continue
        latent = cache[0]
        latent.keys = normal((1, 1, capacity, c.kv_lora_rank), 1.0, dtype)
        latent.values = mx.zeros((1, 1, capacity, 0), dtype=dtype)
        latent.offset = context
        if layer.self_attn.indexer is not None:
            fill_indexer_caches(cache[1], cache[2], c, context, capacity, lambda shape: normal(shape, 1.0, dtype))
    mx.eval(cache_arrays(caches))
    return caches


def fill_indexer_caches(valid, pool, config, context, capacity, normal):
    """An indexer's key-validity KVCache and PoolingCache after a ``context``-token prefill."""
    valid.keys = mx.ones((1, 1, capacity, 1), dtype=mx.bool_)
    valid.values = mx.zeros((1, 1, capacity, 0), dtype=mx.bool_)
    valid.offset = context
    if context // pool.ratio:
        pool.pooled = normal((1, context // pool.ratio, config.index_head_dim))
    pool.buf_kv = normal((1, pool.ratio, config.index_head_dim))
    pool.buf_gate = normal((1, pool.ratio, config.index_head_dim))
    pool.remainder = context % pool.ratio


def cache_arrays(cache):
    """Every non-empty array a cache (or a list of caches) holds."""
    from mlx_vlm.models import cache as caches

    if isinstance(cache, (list, tuple)):
        return [a for c in cache for a in cache_arrays(c)]
    if isinstance(cache, caches.CacheList):
        return cache_arrays(list(cache.caches))
    if isinstance(cache, caches.ArraysCache):
        return [a for a in cache.cache if a is not None and a.size]
    names = ("keys", "values", "pooled", "buf_kv", "buf_gate")
    return [getattr(cache, n) for n in names if getattr(cache, n, None) is not None and getattr(cache, n).size]


def clone_cache(cache):
    """An independent copy: the clone's in-place updates never reach the original."""
    import copy

    from mlx_vlm.models import cache as caches

    if isinstance(cache, (list, tuple)):
        return [clone_cache(c) for c in cache]
    if isinstance(cache, caches.CacheList):
        return caches.CacheList(*(clone_cache(c) for c in cache.caches))
    new = copy.copy(cache)
    if isinstance(cache, caches.ArraysCache):
        new.cache = [None if a is None else mx.array(a) for a in cache.cache]
    for name in ("keys", "values", "pooled", "buf_kv", "buf_gate"):
        if getattr(cache, name, None) is not None:
            setattr(new, name, mx.array(getattr(cache, name)))
    return new
