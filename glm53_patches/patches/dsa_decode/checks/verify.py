"""``glm53-patches verify dsa_decode``: stock against patched on this machine's backend.

1. a real-dimension indexer (32 heads x 128, pools of 16, 2048 keys) in bf16,
   decode steps from synthetic caches at contexts on both sides of the point
   where it starts selecting (2048 keys) and at 4k/16k, batch 1 and 2, top-k
   compared exactly; then verify blocks of 2 to 8 tokens from the same
   contexts, at batch 2 with a padded position;
2. the attention over the selected latent rows at real dimensions (64 heads,
   latent 512), bf16 (fp32 on the CPU), contexts 4k/16k, batch 1 and 2,
   selections with -1 slots; a decode token, and verify blocks of 4 tokens
   (every position, and the last only);
3. greedy decode of the tiny random-weight model, batch 1 and 2, logits bit
   for bit; then its speculative verify blocks (logits and caches);
4. on a GPU, 1 and 3 again with the one-launch selection kernel
   (``select_kernel.py``) forced on, 1 also at 32k and 128k keys (2,048 and
   8,192 pools: the kernel's capacity on CUDA); 1-3 run with it forced off.
"""

import time

import mlx.core as mx
from mlx.utils import tree_map

from glm53_patches import tiny_model
from glm53_patches.bench import synthetic
from glm53_patches.exactness import Tally

STEPS = 8
# The kernel's indexer contexts: those of the compiled path, then 2,048 and 8,192 pools.
KERNEL_CONTEXTS = (2040, 4096, 16384, 32768, 131072)


def _indexer(dtype):
    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import Glm5NextIndexer

    config = TextConfig()
    indexer = Glm5NextIndexer(config, layer_idx=0)
    indexer.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape, key=mx.random.key(p.size % 997)),
                            indexer.parameters()))
    indexer.set_dtype(dtype)
    indexer.eval()
    return indexer, config


def _caches(config, context, batch, dtype):
    from mlx_vlm.models.cache import KVCache, PoolingCache

    valid, pool = KVCache(), PoolingCache(config.index_kpool)
    capacity = -(-(context + 256) // 256) * 256
    key = iter(mx.random.split(mx.random.key(context), 4))
    synthetic.fill_indexer_caches(valid, pool, config, context, capacity,
                                  lambda shape: mx.random.normal((batch, *shape[1:]), key=next(key)).astype(dtype))
    valid.keys = mx.broadcast_to(valid.keys, (batch, *valid.keys.shape[1:]))
    valid.values = mx.broadcast_to(valid.values, (batch, *valid.values.shape[1:]))
    return valid, pool


def check_indexer(tally, stock, fast, contexts=(2040, 4096, 16384), batches=(1, 2), dtype=mx.bfloat16, label="",
                  blocks=False):
    """STEPS decode tokens from each context; ``blocks``: verify blocks instead, of 2 to 8 tokens (one length
    per step), with a padded position in a second row."""
    indexer, config = _indexer(dtype)
    for context in contexts:
        for batch in batches:
            outputs = []
            for fn in (stock, fast):
                valid, pool = _caches(config, context, batch, dtype)
                steps, offset = [], context
                for step in range(STEPS):
                    length = 2 + step % 7 if blocks else 1
                    key = mx.random.key(1000 * context + step)
                    x = mx.random.normal((batch, length, config.hidden_size), key=key).astype(dtype)
                    q_resid = mx.random.normal((batch, length, config.q_lora_rank), key=key).astype(dtype)
                    mask = None
                    if blocks and batch > 1:
                        mask = mx.array([[r == 0 or i != step % length for i in range(length)] for r in range(batch)])
                    steps.append(fn(indexer, x, q_resid, mask, valid, pool, offset))
                    mx.eval(steps[-1])
                    offset += length
                outputs.append(steps)
            what = "blocks of 2-8" if blocks else "tokens"
            tally.compare(f"{label}indexer {dtype} ctx {context} B={batch} {what}", *outputs)


def _attention(dtype, context, batch, length=1):
    """A real-dimension DSA attention (the parts decode reads) and ``_attend``'s inputs for ``length`` tokens."""
    from mlx_vlm.models.cache import KVCache
    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import Glm5NextAttention

    config = TextConfig()
    attention = Glm5NextAttention(config, config.layer_types.index("deepseek_sparse_attention"))
    for module in (attention.embed_q, attention.unembed_out):  # all that _attend's decode reads
        module.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape, key=mx.random.key(p.size % 991)),
                               module.parameters()))
        module.set_dtype(dtype)
    attention.eval()  # a training module takes the prefill branch
    width = config.index_topk + config.index_kpool - 1
    key = iter(mx.random.split(mx.random.key(context + batch), 3))
    latent = mx.random.normal((batch, 1, context, config.kv_lora_rank), key=next(key)).astype(dtype)
    q = mx.random.normal((batch, config.num_attention_heads, length, config.qk_nope_head_dim), key=next(key)).astype(dtype)
    topk = mx.random.randint(0, context, (batch, length, width), key=next(key)).astype(mx.int32)
    topk = mx.where(mx.arange(width) % 7 == 3, -1, topk)  # invalid slots, as padding leaves them
    mx.eval(attention.parameters(), latent, q, topk)
    return attention, config, (q, latent, latent[:, :, -length:], topk, KVCache(), None)


def check_attend(tally, stock, fast, contexts=(4096, 16384), batches=(1, 2), dtype=None):
    """Decode tokens, then verify blocks of 4 tokens (all positions, and the drafter's ``last_only``)."""
    from glm53_patches.registry import backend

    # bf16 as served; fp32 on the CPU, whose bf16 matmuls are very slow.
    dtype = dtype or (mx.float32 if backend() == "cpu" else mx.bfloat16)
    for length, last_only in ((1, False), (4, False), (4, True)):
        for context in contexts:
            for batch in batches:
                attention, _, inputs = _attention(dtype, context, batch, length)
                outputs = [list(fn(attention, *inputs, last_only)) for fn in (stock, fast)]
                block = "" if length == 1 else f" block of {length}{' last only' if last_only else ''}"
                tally.compare(f"attend {dtype} ctx {context} B={batch}{block}", *outputs)


def check_model(tally, stock, fast, steps=24, label=""):
    """``stock`` and ``fast``: (indexer __call__, attention _attend) pairs."""
    from mlx_vlm.models.glm5_next.language import Glm5NextAttention, Glm5NextIndexer

    slots = ((Glm5NextIndexer, "__call__"), (Glm5NextAttention, "_attend"))
    installed = [vars(owner)[attr] for owner, attr in slots]
    try:
        language_model = tiny_model.build_model(seed=0).language_model
    except ImportError as exc:  # a bare GPU machine without mlx-vlm's processor dependencies
        tally.notes.append(f"tiny model skipped: {exc}")
        return
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(56)]])
    runs = {"": lambda tokens: tiny_model.greedy_logits(language_model, tokens, steps),
            " verify blocks": lambda tokens: tiny_model.speculative_outputs(language_model, tokens)}
    for batch, tokens in ((1, prompt), (2, mx.concatenate([prompt, prompt[:, ::-1]]))):
        for what, run in runs.items():
            results = []
            for functions in (stock, fast):
                try:
                    for (owner, attr), fn in zip(slots, functions):
                        setattr(owner, attr, fn)
                    results.append(run(tokens))
                finally:
                    for (owner, attr), fn in zip(slots, installed):
                        setattr(owner, attr, fn)
            tally.compare(f"{label}tiny model fp32 B={batch}{what}", *results)


def verify():
    from glm53_patches import registry

    from .. import PATCH
    from ..decode import make_attend, make_call, switch

    start = time.perf_counter()
    indexer_target, attend_target = PATCH.targets
    stock = registry.upstream(indexer_target)  # stock even while patches are applied
    stock_attend = registry.upstream(attend_target)
    tally = Tally()
    before = PATCH.stats.snapshot()["hits"]
    gpu = registry.backend() in PATCH.kernels_on
    with switch.forcing(False):  # the compiled selection
        for blocks in (False, True):
            check_indexer(tally, stock, make_call(stock), blocks=blocks)
        check_attend(tally, stock_attend, make_attend(stock_attend))
        check_model(tally, (stock, stock_attend), (make_call(stock), make_attend(stock_attend)))
    if gpu:  # the one-launch selection kernel
        with switch.forcing(True):
            for blocks in (False, True):
                check_indexer(tally, stock, make_call(stock), contexts=KERNEL_CONTEXTS, label="kernel ", blocks=blocks)
            check_model(tally, (stock, stock_attend), (make_call(stock), make_attend(stock_attend)), label="kernel ")
    after = PATCH.stats.snapshot()["hits"]
    paths = ("indexer", "indexer block", "attend") + (("indexer kernel", "indexer block kernel") if gpu else ())
    for path in paths:  # equal outputs prove nothing if stock ran both times
        if after.get(path, 0) == before.get(path, 0):
            tally.mismatches.append(f"the {path} fast path never ran")
    return tally.result(time.perf_counter() - start)
