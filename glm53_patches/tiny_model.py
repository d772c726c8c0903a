"""A tiny random-weight GLM-5.3-Flash-style checkpoint for offline tests.

Every layer kind of mlx-vlm's ``glm5_next`` model is present: KDA linear
attention, DSA sparse attention with full and shared indexers, a dense MLP,
MoE FFNs and hyper-connections. Weights are seeded, so the same arguments
always give byte-identical files, and the checkpoint loads with the stock
``mlx_vlm.load`` and ``python -m mlx_vlm.server`` without network access.
"""

import argparse
import copy
import functools
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

# GLM-style control tokens. The BPE trainer gives special tokens the first
# ids in this order, so ids are known without building the tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
    "<|end_of_video|>", "<|image|>", "<|video|>", "<think>", "</think>",
]
TOKEN_ID = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = 512
QUANTIZE_BITS = (4, 6, 8)  # what --quantize-bits takes: the widths GLM-5.3-Flash's projections use
# Generation stops at end-of-text or when the model starts a new turn (as GLM).
EOS_TOKEN_IDS = [TOKEN_ID[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}
{%- if part.type == 'text' -%}{{ part.text }}
{%- elif part.type in ('image', 'image_url') -%}<|begin_of_image|><|image|><|end_of_image|>
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
[gMASK]<sop>
{%- for message in messages -%}
<|{{ 'observation' if message.role == 'tool' else message.role }}|>
{{ text(message.content) }}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>
{% endif -%}
"""

# Fixed training text for the BPE vocabulary (any English prose would do).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model is a useful thing
to have when the real one is far too large to run in a test. It has the same
shape of layers, the same kinds of attention and the same mixture of experts,
but every matrix is tiny and every weight is random. The tokens it writes are
not meant to make sense; they are only meant to be different from each other,
so that a change in the code that changes the numbers will be seen at once.
Linear attention keeps a running state for each head and forgets a little of
it at every step. Sparse attention looks back over the whole context, but it
only reads the pools of keys that an indexer scores as the most relevant ones.
Some layers compute their own selection; others share the choice made by the
layer before them. Hyper-connections keep several residual streams and mix
them with learned weights before and after each block of the network.
Once upon a time there was a village by a river, where the people made bread
in the morning and told stories in the evening. The children asked questions
about the stars, the weather, the animals in the forest and the boats on the
water, and the old teacher answered every one of them with patience and care.
What is the capital of France? Paris is the capital of France. How many days
are there in a week? There are seven days in a week. Please write a short poem
about the sea, the wind and the light of the moon over the quiet harbour.
Numbers such as 1, 2, 3, 10, 42, 100 and 2026 appear in text, as do symbols
like (parentheses), [brackets], {braces}, "quotes", commas, colons: and dots.
"""


def tiny_config(**overrides):
    """The config.json dict of the tiny model.

    ``overrides`` update ``text_config`` (where nearly every knob lives);
    ``vision_config=dict(...)`` updates the vision tower.
    """
    vision_overrides = overrides.pop("vision_config", {})
    L, D = "linear_attention", "deepseek_sparse_attention"
    text = {
        "model_type": "glm5_next_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 8,
        "layer_types": [L, L, D, L, L, D, L, D],
        # One letter per layer; only the DSA layers (2, 5, 7) read theirs.
        # Layer 5 reuses layer 2's selection, layer 7 computes its own.
        "index_topk_pattern": "FFFFFSFF",
        "mlp_layer_types": ["dense"] + ["sparse"] * 7,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "index_n_heads": 4,
        "index_head_dim": 64,
        # 64 keys = 16 pools of 4: prompts over 64 tokens make the indexer
        # drop pools, shorter ones keep every pool.
        "index_topk": 64,
        "index_kpool": 4,
        "linear_attn_config": {
            "head_dim": 64,  # KDA kernels need a multiple of 32
            "num_heads": 4,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "safe_gate": True,
        },
        "hc_mult": 4,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
        "eos_token_id": EOS_TOKEN_IDS,
        "dtype": "float32",  # mlx_vlm convert keeps this dtype when re-quantizing
    }
    text.update(overrides)
    vision = {
        "model_type": "glm5_next_vision",
        "depth": 1,  # kept so the checkpoint is complete; text tests skip it
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "projection_intermediate_size": 64,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    vision.update(vision_overrides)
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text,
        "vision_config": vision,
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "tie_word_embeddings": text["tie_word_embeddings"],
        "eos_token_id": EOS_TOKEN_IDS,
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
        "image_token_id": TOKEN_ID["<|image|>"],
        "video_token_id": TOKEN_ID["<|video|>"],
        "image_start_token_id": TOKEN_ID["<|begin_of_image|>"],
        "image_end_token_id": TOKEN_ID["<|end_of_image|>"],
        "video_start_token_id": TOKEN_ID["<|begin_of_video|>"],
        "video_end_token_id": TOKEN_ID["<|end_of_video|>"],
    }


def _init_param(path, shape, key):
    """A deterministic init that keeps activations O(1) through the stack."""
    *owner, leaf = path.split(".")
    module = owner[-1] if owner else ""

    def normal(std):
        return std * mx.random.normal(shape, key=key)

    def uniform(low, high):
        return mx.random.uniform(low, high, shape, key=key)

    if leaf == "A_log":  # decay rates exp(A_log) in [1, 4]
        return uniform(0.0, math.log(4.0))
    if leaf == "dt_bias":  # negative, so KDA forgets slowly (gate ~ 0.8-0.95)
        return uniform(-4.0, -1.0)
    if leaf == "e_score_correction_bias":  # nudges expert choice, not dominant
        return normal(0.05)
    if leaf == "index_kpool_compress_ape":
        return normal(0.5)
    if module.endswith("_hc") and leaf == "base":
        return normal(0.5)
    if module.endswith("_hc") and leaf == "scale":
        return uniform(0.5, 1.5)
    if "norm" in module:  # RMSNorm/LayerNorm: identity plus a little noise
        return 1.0 + normal(0.1) if leaf == "weight" else mx.zeros(shape)
    if leaf == "bias":
        return mx.zeros(shape)
    if module == "embed_tokens":
        return normal(1.0)
    is_conv = len(shape) > 2 and ("conv" in module or module in ("proj", "downsample"))
    if is_conv:  # MLX conv weights are [out, *kernel, in]: fan-in is the rest
        return normal(1.0 / math.sqrt(math.prod(shape[1:])))
    # Linear, SwitchLinear, MultiLinear, router, HC fn, index gate: [..., in].
    return normal(1.0 / math.sqrt(shape[-1]))


def _quantize(model, bits):
    """Quantize like ``mlx_vlm convert``; returns its ``quantization`` entry."""
    from mlx_vlm.utils import skip_multimodal_module

    model_predicate = model.quant_predicate  # HC, index_kpool_compress stay fp

    def wanted(path, module):
        # Router (MoEGate), norms and convs have no to_quantized: never quantized.
        return (
            hasattr(module, "to_quantized")
            and not skip_multimodal_module(path)
            and model_predicate(path, module)
        )

    modules = [m for p, m in model.named_modules() if wanted(p, m)]
    group_size = 64 if all(m.weight.shape[-1] % 64 == 0 for m in modules) else 32
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        mode="affine",
        class_predicate=lambda p, m: wanted(p, m) and m.weight.shape[-1] % group_size == 0,
    )
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def _build(quantize_bits, seed, config_overrides):
    from mlx_vlm.models.glm5_next import Model, ModelConfig

    if quantize_bits is not None and quantize_bits not in QUANTIZE_BITS:
        raise ValueError(f"quantize_bits must be None or one of {QUANTIZE_BITS}")
    config = tiny_config(**config_overrides)
    model = Model(ModelConfig.from_dict(copy.deepcopy(config)))
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    model.update(
        tree_unflatten(
            [
                (path, _init_param(path, value.shape, keys[i]).astype(mx.float32))
                for i, (path, value) in enumerate(params)
            ]
        )
    )
    if quantize_bits:
        config["quantization"] = _quantize(model, quantize_bits)
        config["quantization_config"] = dict(config["quantization"])
    mx.eval(model.parameters())
    model.eval()
    return model, config


def build_model(*, quantize_bits=None, seed=0, **config_overrides):
    """The tiny model in memory: mlx-vlm's glm5_next ``Model``, fp32 weights.

    ``quantize_bits`` (4, 6 or 8) quantizes in process the way ``convert`` does.
    """
    return _build(quantize_bits, seed, config_overrides)[0]


@functools.lru_cache(maxsize=1)
def _tokenizer_json():
    """A 512-token byte-level BPE trained on the fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()  # mlx-vlm then streams with its BPE detokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    assert all(tokenizer.token_to_id(t) == i for t, i in TOKEN_ID.items())
    return tokenizer.to_str(pretty=True)


def _json(obj):
    return json.dumps(obj, indent=4, sort_keys=True) + "\n"


def gpu_widths():
    """Overrides that make every quantized matmul's input width, and the MLA's per-head widths, 128
    (as in the real model): MLX 0.32.4's CUDA quantized_matmul has no kernel for the tiny model's
    64-wide per-head MLA projections (an H200 raised on 40x64x64 x 4 heads)."""
    kda = tiny_config()["text_config"]["linear_attn_config"]
    wide = ("moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_head_dim")
    return {**dict.fromkeys(wide, 128), "linear_attn_config": {**kda, "head_dim": 128}}


def greedy_logits(language_model, tokens, steps, cache=None):
    """Prefill ``tokens`` ([B, L]), then ``steps`` greedy single-token steps.

    Returns the last-position logits of the prefill and of every step, each
    evaluated as it is produced (what exactness tests compare bit for bit).
    """
    cache = language_model.make_cache() if cache is None else cache
    logits = [language_model(tokens, cache=cache).logits[:, -1]]
    for _ in range(steps):
        token = mx.argmax(logits[-1], axis=-1)
        logits.append(language_model(token[:, None], cache=cache).logits[:, -1])
        mx.eval(logits[-1])
    return logits


def speculative_logits(language_model, tokens, rounds, cache=None, seed=1):
    """Prefill ``tokens``, then ``rounds`` speculative verify blocks as mlx-vlm's MTP loop runs them on
    the target, each followed by one greedy decode step.

    A block is ``start_speculative_cache``, one forward of 2 to 8 random tokens, and a commit of a random
    accepted prefix per row (a rollback of the rest). Returns every block's logits (all positions) and
    every step's last-position logits, each evaluated as it is produced, and the cache.
    """
    from mlx_vlm.generate.ar import _make_cache
    from mlx_vlm.speculative.cache_state import start_speculative_cache

    rng = np.random.default_rng(seed)
    batch = tokens.shape[0]
    if cache is None:  # a batch gets the batch generator's caches, which commit per row
        cache = language_model.make_cache() if batch == 1 else _make_cache(language_model, [0] * batch)
    logits = [language_model(tokens, cache=cache).logits[:, -1]]
    for round_ in range(rounds):
        length = 2 + round_ % 7
        block = mx.array(rng.integers(20, 500, (batch, length)), dtype=mx.int32)
        transaction = start_speculative_cache(cache, length)
        logits.append(language_model(block, cache=cache).logits)
        mx.eval(logits[-1])
        transaction.commit([int(k) for k in rng.integers(1, length + 1, batch)])  # accepted + bonus
        step = mx.argmax(logits[-1][:, -1], axis=-1)[:, None]
        logits.append(language_model(step, cache=cache).logits[:, -1])
        mx.eval(logits[-1])
    return logits, cache


def speculative_outputs(language_model, tokens, rounds=7):
    """What a verify-block comparison checks: ``speculative_logits``' logits, then every array the
    cache holds after the last block's rollback and step."""
    logits, cache = speculative_logits(language_model, tokens, rounds)
    return logits + [a for _, a in tree_flatten([c.state for c in cache]) if a is not None]


def write_tiny_model(out_dir, *, quantize_bits=None, seed=0, **config_overrides):
    """Write a complete, loadable checkpoint directory and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, config = _build(quantize_bits, seed, config_overrides)
    # Internal MLX names, which Model.sanitize passes through unchanged; the
    # safetensors data order follows dict order, so sort for stable bytes.
    weights = dict(sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    eot = "<|endoftext|>"
    files = {
        "config.json": _json(config),
        "tokenizer.json": _tokenizer_json(),
        "tokenizer_config.json": _json(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "[gMASK]",
                "eos_token": eot,
                # mlx-vlm tokenizes with padding=True; a pad token keeps that
                # from failing with "Asking to pad ..." on other versions.
                "pad_token": eot,
                "unk_token": None,
                "additional_special_tokens": SPECIAL_TOKENS[1:],
                "clean_up_tokenization_spaces": False,
                "model_max_length": config["text_config"]["max_position_embeddings"],
                "padding_side": "left",
            }
        ),
        "special_tokens_map.json": _json(
            {"bos_token": "[gMASK]", "eos_token": eot, "pad_token": eot}
        ),
        # Without it apply_chat_template silently returns the raw prompt.
        "chat_template.jinja": CHAT_TEMPLATE,
        "generation_config.json": _json(
            {
                "do_sample": False,
                "eos_token_id": EOS_TOKEN_IDS,
                "pad_token_id": TOKEN_ID[eot],
            }
        ),
    }
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="glm53-patches tiny-model",
        description="Write a tiny random-weight glm5_next checkpoint.",
    )
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--quantize-bits", type=int, choices=QUANTIZE_BITS, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_model(args.dir, quantize_bits=args.quantize_bits, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
