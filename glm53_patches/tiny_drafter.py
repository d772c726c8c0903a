"""A tiny glm5_next MTP drafter that matches a tiny target checkpoint.

mlx-vlm's native drafter (``speculative/drafters/glm5_next_mtp``) is one
decoder layer after the target's: it reads the target's last hidden state and
the next token's embedding, and predicts the token after that through the
target's own LM head. A random drafter would almost never agree with a random
target, so speculation would always reject and rollback after an accepted token
would go untested. So ``eh_proj``, the projection that feeds the drafter's layer, is
fitted (ridge regression, float64) to the target's greedy continuations of
``DRAFTER_PROMPTS``. On those prompts the first drafted token of a round is
usually accepted and later ones usually are not. That mix is what tests of
rollback need. On other prompts it drafts nearly at random, like any
mismatched drafter. Its layer stays random and small, so it is computed but
barely moves the prediction.
"""

import copy
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import tiny_model

# The user messages whose greedy answers the drafter learns (the server tests ask these).
DRAFTER_PROMPTS = [
    "Tell me a story about a lighthouse keeper who counts ships.",
    "List three prime numbers and explain why each is prime.",
    "Write a haiku about cache lines.",
]
ROLLOUT_TOKENS = 64  # answers longer than this are drafted at random past it
BLOCK_SCALE = 0.05  # the drafter layer's output projections, scaled down
_EPS = 1e-5  # the drafter's RMSNorm eps (tiny_config's rms_norm_eps)


def drafter_config(target_config):
    """The drafter's config.json: the target's text config under the MTP model type."""
    return {
        "architectures": ["Glm5NextMTPModel"],
        "model_type": "glm5_next_mtp",
        "text_config": copy.deepcopy(target_config["text_config"]),
    }


def _chat_ids(processor, config, prompt):
    """The prompt's token ids as mlx-vlm builds them for one user message."""
    from mlx_vlm.prompt_utils import apply_chat_template

    text = apply_chat_template(processor, config, prompt, num_images=0)
    tokenizer = getattr(processor, "tokenizer", processor)
    return tokenizer.encode(text, add_special_tokens=False)


def _greedy(language_model, ids, steps, eos):
    """``ids`` followed by up to ``steps`` greedy tokens (stopping after an end token)."""
    cache = language_model.make_cache()
    logits = language_model(mx.array([ids]), cache=cache).logits[:, -1]
    out = list(ids)
    for _ in range(steps):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        if token in eos:
            break
        logits = language_model(mx.array([[token]]), cache=cache).logits[:, -1]
    return out


def _dense_weight(linear):
    """A Linear's weight, dequantized where the checkpoint is quantized."""
    if not hasattr(linear, "scales"):
        return linear.weight
    return mx.dequantize(linear.weight, linear.scales, linear.biases, linear.group_size, linear.bits)


def _training_pairs(target_dir):
    """(features, wanted output, LM head): what the drafter sees at each position, and the
    unit-RMS LM-head row of the token the target chose two positions later."""
    from mlx_vlm import load

    model, processor = load(str(target_dir))
    language_model = model.language_model
    embed = language_model.model.embed_tokens
    head = np.array(_dense_weight(language_model.lm_head), dtype=np.float64)
    eos = set(tiny_model.EOS_TOKEN_IDS)
    features, wanted = [], []
    for prompt in DRAFTER_PROMPTS:
        sequence = _greedy(language_model, _chat_ids(processor, model.config, prompt), ROLLOUT_TOKENS, eos)
        tokens = mx.array([sequence])
        hidden = language_model(tokens, return_hidden=True).hidden_states[0][0]  # normed, [L, D]
        n = len(sequence) - 2
        # Position t: the embedding of token t+1 and the target's hidden at t predict token t+2.
        x = mx.concatenate(
            [mx.fast.rms_norm(embed(tokens)[0, 1 : n + 1], None, _EPS), mx.fast.rms_norm(hidden[:n], None, _EPS)],
            axis=-1,
        )
        features.append(np.array(x, dtype=np.float64))
        wanted.append(head[np.array(sequence[2:])])
    wanted = np.concatenate(wanted)
    wanted *= np.sqrt(head.shape[1]) / np.linalg.norm(wanted, axis=-1, keepdims=True)
    return np.concatenate(features), wanted


def _fitted_eh_proj(target_dir, ridge=1e-3):
    x, y = _training_pairs(target_dir)
    solution = np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ y)  # [2D, D]
    return mx.array(solution.T.astype(np.float32))  # nn.Linear weight: [out, in]


def write_tiny_drafter(target_dir, out_dir, *, seed=0):
    """Write a drafter checkpoint for the tiny checkpoint at ``target_dir``; returns its path."""
    from mlx_vlm.speculative.drafters.glm5_next_mtp import Model, ModelConfig

    target_dir, out = Path(target_dir), Path(out_dir)
    config = drafter_config(json.loads((target_dir / "config.json").read_text()))
    model = Model(ModelConfig.from_dict(copy.deepcopy(config)))
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed + 1), len(params))
    weights = {}
    for i, (path, value) in enumerate(params):
        weight = tiny_model._init_param(path, value.shape, keys[i]).astype(mx.float32)
        if path in ("enorm.weight", "hnorm.weight", "shared_head_norm.weight"):
            weight = mx.ones(value.shape)  # the fit assumes plain RMS normalization
        elif path.endswith(("o_proj.weight", "unembed_out.weight", "down_proj.weight")):
            weight = BLOCK_SCALE * weight
        weights[path] = weight
    weights["eh_proj.weight"] = _fitted_eh_proj(target_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "mlx"})
    (out / "config.json").write_text(tiny_model._json(config), encoding="utf-8")
    return out
