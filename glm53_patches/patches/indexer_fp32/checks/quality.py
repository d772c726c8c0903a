"""Quality figures for indexer_fp32: ``python -m glm53_patches.patches.indexer_fp32.checks.quality``.

1. Top-k overlap at real dimensions (32 heads x 128, bf16 q and pool keys,
   float32 head weights, 4k/16k/32k keys = 256/1024/2048 pools of 16, 128
   pools selected): the fraction of a float64 reference's selected pools that
   each arm also selects.
2. Teacher-forced KL on the tiny random-weight model (4-bit weights, bf16
   activations, index_topk 16 = 4 pools of 4 keys selected): KL(reference ||
   arm) per position, where the reference scores pools in float64 and
   everything else is the same model.

Arms: ``stock`` (mlx-vlm's code), ``patch`` (this patch as it runs on the
current device: the compiled function, or the kernel on a GPU with
``--kernel``), and ``kernel-order`` (``kernel_order_scores``: the GPU
kernel's arithmetic emulated with MLX ops on the CPU, for machines without
the GPU); ``model-dtype`` is a positive control (dot products in bf16) that
shows the measurements can see a numerics change.
"""

import argparse
import contextlib
import time

import mlx.core as mx
import numpy as np

F32, F64 = mx.float32, mx.float64
LANES = 32


# -- scorers ---------------------------------------------------------------------------


def reference_scores(q, keys, weights, scale):
    """sum_h relu(q_h . k) * weights_h * scale in float64 (numpy), from the inputs' exact values."""
    q64 = np.array(q.astype(F32), dtype=np.float64)
    k64 = np.array(keys.astype(F32), dtype=np.float64)
    w64 = np.array(weights.astype(F32), dtype=np.float64) * scale
    dots = q64 @ k64[:, None].swapaxes(-1, -2)  # [B, L, H, P]
    return (np.maximum(dots, 0.0) * w64[..., None]).sum(axis=2)


def _fma(a, b, c):
    """float32 fma(a, b, c): the product is exact in float64, then one rounding
    (up to rare double rounding through float64)."""
    return (a.astype(F64) * b.astype(F64) + c.astype(F64)).astype(F32)


def kernel_order_scores(q, keys, ws):
    """What ``kernels.py`` computes, with its order of operations, on any device.

    Per head: ``dot = fma(q[d], k[d], dot)`` for d in order; lane ``i`` holds
    ``fma(relu(dot_h), ws_h, partial)`` over heads i, i + 32, ...; lanes are
    summed by the CUDA xor butterfly (Metal's ``simd_sum`` order is the
    hardware's; the butterfly stands in for it). Runs on the CPU: GPUs have no float64.
    """
    with mx.stream(mx.cpu):
        return _kernel_order_scores(q, keys, ws)


def _kernel_order_scores(q, keys, ws):
    batch, length, heads, dim = q.shape
    pools = keys.shape[1]
    qf, kf = q.astype(F32), keys.astype(F32)
    dot = mx.zeros((batch, length, heads, pools), dtype=F32)
    for d in range(dim):
        dot = _fma(qf[..., d, None], kf[:, None, None, :, d], dot)
        if d % 16 == 15:
            mx.eval(dot)  # keep the lazy graph short
    relu = mx.where(dot < 0, 0.0, dot)
    wsf = ws.astype(F32)
    lanes = [mx.zeros((batch, length, pools), dtype=F32) for _ in range(LANES)]
    for h in range(heads):
        lanes[h % LANES] = _fma(relu[:, :, h], wsf[:, :, h, None], lanes[h % LANES])
    for offset in (16, 8, 4, 2, 1):
        lanes = [lanes[i] + lanes[i ^ offset] for i in range(LANES)]
    return lanes[0]


# -- arms --------------------------------------------------------------------------------


@contextlib.contextmanager
def arm(name, kernel=False):
    """Within the block, glm5_next's indexer scores pools the way ``name`` says."""
    from mlx_vlm.models.glm5_next import language

    from .. import PATCH, score

    stock_score, stock_select = language._score_index_keys, language._exact_pool_select
    if name == "patch":
        score._FORCED[0] = bool(kernel)
        language._score_index_keys = score.make_score(stock_score)
        language._exact_pool_select = score.make_select(stock_select)
    elif name == "reference":
        language._score_index_keys = lambda q, keys, weights, scale: mx.array(
            reference_scores(q, keys, weights, scale)
        )
    elif name == "kernel-order":
        language._score_index_keys = lambda q, keys, weights, scale: kernel_order_scores(
            q, keys, weights * scale
        )
    elif name == "model-dtype":
        # Positive control: the dot products in q's dtype (bf16), as the comment
        # above stock's call describes. Shows the measurements can see a change.
        language._score_index_keys = lambda q, keys, weights, scale: (
            mx.maximum(q @ keys[:, None].swapaxes(-1, -2), 0).astype(F32) * (weights * scale)[..., None]
        ).sum(axis=2)
    elif name != "stock":
        raise ValueError(name)
    PATCH.stats.reset()
    try:
        yield
    finally:
        language._score_index_keys, language._exact_pool_select = stock_score, stock_select
        score._FORCED[0] = None


# -- 1. top-k overlap at real dimensions ------------------------------------------------------


def real_inputs(pools, queries, *, heads=32, dim=128, kpool=16, seed=0):
    """bf16 q [1, L, H, D] and pool keys [1, P, D], float32 weights, the last L positions."""
    kq, kk, kw = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, queries, heads, dim), key=kq).astype(mx.bfloat16)
    keys = mx.random.normal((1, pools, dim), key=kk).astype(mx.bfloat16)  # k_norm'd, ~unit scale
    weights = mx.random.normal((1, queries, heads), key=kw).astype(mx.bfloat16)
    weights = weights.astype(F32) * heads**-0.5  # as _project_queries
    kv_length = pools * kpool
    pool_ends = (mx.arange(pools) * kpool + kpool - 1)[None]
    pool_valid = mx.ones((1, pools), dtype=mx.bool_)
    positions = kv_length - queries + mx.arange(queries)
    mx.eval(q, keys, weights, pool_ends, positions)
    return q, keys, weights, pool_ends, pool_valid, positions


def reference_selection(q, keys, weights, pool_ends, pool_valid, positions, select_k, scale):
    scores = reference_scores(q, keys, weights, scale)
    candidates = np.array(pool_valid[:, None] & (pool_ends[:, None] <= positions[None, :, None]))
    scores = np.where(candidates, scores, -np.inf)
    return np.argsort(-scores, axis=-1, kind="stable")[..., :select_k]


def overlap(selected, reference):
    """Mean over queries of |selected & reference| / k."""
    selected, reference = np.array(selected), np.array(reference)
    k = reference.shape[-1]
    rows = selected.reshape(-1, k), reference.reshape(-1, k)
    return float(np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(*rows)]))


def overlap_figures(pool_counts=(256, 1024, 2048), queries=64, select_k=128, kernel=False, seed=0):
    from mlx_vlm.models.glm5_next import language

    scale = 128**-0.5
    rows = []
    for pools in pool_counts:
        inputs = real_inputs(pools, queries, seed=seed)
        reference = reference_selection(*inputs, select_k, scale)
        row = {"pools": pools, "queries": queries}
        for name in ("stock", "patch", "kernel-order", "model-dtype"):
            with arm(name, kernel=kernel):
                selected, _ = language._exact_pool_select(*inputs, select_k, scale)
                row[name] = overlap(selected, reference)
        rows.append(row)
    return rows


# -- 2. teacher-forced KL on the tiny model ---------------------------------------------------


def tiny_bf16_model(seed=0, index_topk=16):
    """The tiny model with 4-bit weights and bf16 activations (gather_qmm runs on CPU)."""
    from mlx.utils import tree_map_with_path

    from glm53_patches.tiny_model import build_model

    model = build_model(quantize_bits=4, seed=seed, index_topk=index_topk)
    lm = model.language_model
    keep = lm.cast_predicate  # what mlx-vlm leaves in float32 when loading
    lm.update(
        tree_map_with_path(
            lambda path, p: p.astype(mx.bfloat16) if p.dtype == F32 and keep(path) else p,
            lm.parameters(),
        )
    )
    mx.eval(lm.parameters())
    return lm


def teacher_forced_logits(lm, tokens, prefill):
    """float64 log-probabilities at every position: one prefill, then one token per step."""
    cache = lm.make_cache()
    logits = [lm(tokens[:, :prefill], cache=cache).logits[0]]
    for i in range(prefill, tokens.shape[1]):
        logits.append(lm(tokens[:, i : i + 1], cache=cache).logits[0])
        mx.eval(logits[-1])
    logits = np.concatenate([np.array(x.astype(F32), dtype=np.float64) for x in logits])
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def kl(reference, other):
    """Per-position KL(reference || other) from log-probabilities."""
    return (np.exp(reference) * (reference - other)).sum(axis=-1)


def kl_figures(length=320, prefill=256, seed=0, arms=("stock", "patch", "kernel-order", "model-dtype"), kernel=False):
    lm = tiny_bf16_model(seed=seed)
    tokens = mx.array(np.random.default_rng(seed).integers(20, 512, size=(1, length)))
    with arm("reference"):
        reference = teacher_forced_logits(lm, tokens, prefill)
    result = {}
    for name in arms:
        with arm(name, kernel=kernel):
            logprobs = teacher_forced_logits(lm, tokens, prefill)
        per_position = kl(reference, logprobs)
        result[name] = {
            "mean_kl": float(per_position.mean()),
            "max_kl": float(per_position.max()),
            "positions_differing": int(np.any(reference != logprobs, axis=-1).sum()),
            "argmax_agree": float((reference.argmax(-1) == logprobs.argmax(-1)).mean()),
        }
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--kl-length", type=int, default=320)
    parser.add_argument("--kl-prefill", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--kernel", action="store_true", help="patch arm uses the GPU kernel")
    args = parser.parse_args(argv)
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    for seed in range(args.seeds):
        start = time.perf_counter()
        for row in overlap_figures(queries=args.queries, kernel=args.kernel, seed=seed):
            print(f"seed {seed} overlap", row)
        print(f"  ({time.perf_counter() - start:.1f} s)")
    for seed in range(args.seeds):
        start = time.perf_counter()
        result = kl_figures(args.kl_length, args.kl_prefill, seed=seed, kernel=args.kernel)
        for name, row in result.items():
            print(f"seed {seed} KL(reference || {name})", row)
        print(f"  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
