"""Exactness checks for hc_decode on this machine's backend.

``verify()`` is what ``glm53-patches verify hc_decode`` runs. It compares,
bit for bit, the patched path against the stock code on the same backend:

1. kernel (GPU backends only): the one-launch Sinkhorn collapse against
   upstream's ``HyperConnection.__call__`` at GLM-5.3-Flash's dimensions
   (hidden 4096, 4 streams, 20 Sinkhorn iterations), bf16 and fp32
   activations, batch 1 and 4;
2. layer: a real-width ``DecoderLayer`` (hidden 4096, a small KDA branch and a
   dense MLP) over a few decode steps and blocks of 8 tokens, batch 1 and 2,
   bf16 and fp32;
3. model: greedy decode of the tiny random-weight model, fp32 and 4-bit,
   comparing every step's logits; then speculative verify blocks of 2 to 8
   tokens (``tiny_model.speculative_outputs``): every block's logits and the
   caches after the rollbacks.

On a GPU backend steps 2 and 3 run twice, with the kernel forced on and off,
so a passing record covers both paths. Nothing global is patched: the patched
layer runs through ``make_call`` on an instance-level subclass.
"""

import time
import zlib
from contextlib import contextmanager

import mlx.core as mx

from mlx_vlm.models.deepseek_v4 import hyper_connection as _hc
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.glm5_next.config import TextConfig

from glm53_patches import tiny_model
from glm53_patches.exactness import Tally
from glm53_patches.backend import current, gpu_backend
from glm53_patches.kernels import hc_sinkhorn

from .. import layer as _layer

def backend_name():
    return current()


def stock_layer_call():
    """``DecoderLayer.__call__`` without hc_decode's wrapper (if it is installed)."""
    fn = _lang.DecoderLayer.__call__
    while getattr(fn, _layer.WRAPPER_MARK, False):
        fn = fn.__wrapped__
    return fn


@contextmanager
def patched_instances(layers):
    """Run ``layers`` through hc_decode's ``__call__`` without patching the class."""
    stock = stock_layer_call()
    subclass = type("HcDecodeLayer", (_lang.DecoderLayer,), {"__call__": _layer.make_call(stock)})
    classes = [type(layer) for layer in layers]
    for layer in layers:
        layer.__class__ = subclass
    try:
        yield
    finally:
        for layer, cls in zip(layers, classes):
            layer.__class__ = cls


def kernel_modes():
    """Kernel forced off everywhere; also forced on where a GPU kernel exists."""
    return (False, True) if gpu_backend() else (False,)


# -- random modules at real width ---------------------------------------------------------


def randomize_hyper_connection(hc, key):
    k1, k2, k3 = mx.random.split(key, 3)
    fan_in = hc.fn.shape[-1]
    hc.fn = mx.random.normal(hc.fn.shape, key=k1) * (2.0 / fan_in**0.5)
    hc.base = mx.random.normal(hc.base.shape, key=k2)
    hc.scale = mx.random.uniform(0.5, 2.0, hc.scale.shape, key=k3)


def randomize(module, key, dtype=mx.float32):
    """Seeded weights that keep activations O(1); HC, A_log, dt_bias stay fp32."""
    from mlx.utils import tree_flatten, tree_unflatten

    params = tree_flatten(module.parameters())
    keys = mx.random.split(key, len(params))
    updated = []
    for (path, value), k in zip(params, keys):
        leaf = path.rsplit(".", 1)[-1]
        keep_fp32 = "_hc." in f".{path}" or leaf in ("A_log", "dt_bias")
        if leaf == "A_log":
            new = mx.random.uniform(0.0, 1.4, value.shape, key=k)
        elif leaf == "dt_bias":
            new = mx.random.uniform(-4.0, -1.0, value.shape, key=k)
        elif "norm" in path and leaf == "weight":
            new = 1.0 + 0.1 * mx.random.normal(value.shape, key=k)
        elif leaf in ("base", "scale", "fn") and "_hc" in path:
            new = value  # replaced below
        else:
            new = mx.random.normal(value.shape, key=k) / max(value.shape[-1], 1) ** 0.5
        updated.append((path, new.astype(mx.float32 if keep_fp32 else dtype)))
    module.update(tree_unflatten(updated))
    for name, child in module.named_modules():
        if isinstance(child, _hc.HyperConnection):
            randomize_hyper_connection(child, mx.random.key(zlib.crc32(name.encode())))


def real_width_layer(dtype, seed=0, hidden=4096):
    """A glm5_next KDA DecoderLayer at the real hidden size, small branches."""
    config = TextConfig(
        hidden_size=hidden,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
        intermediate_size=256,
        linear_attn_config={"head_dim": 64, "num_heads": 2, "short_conv_kernel_size": 4},
    )
    layer = _lang.DecoderLayer(config, 0)
    randomize(layer, mx.random.key(seed), dtype)
    layer.eval()
    mx.eval(layer.parameters())
    return layer, config


# -- the checks ------------------------------------------------------------------------------


def check_kernel(tally, hidden=4096, seeds=4, dtypes=(mx.bfloat16, mx.float32), batches=(1, 4)):
    """The one-launch collapse against upstream's HyperConnection.__call__ (GPU only)."""
    backend = gpu_backend()
    if backend is None:
        tally.notes.append("kernel: no GPU backend here, compiled path only")
        return
    config = TextConfig(hidden_size=hidden)
    for seed in range(seeds):
        hc = _hc.HyperConnection(config)
        randomize_hyper_connection(hc, mx.random.key(1000 + seed))
        for dtype in dtypes:
            for batch in batches:
                x = (3.0 * mx.random.normal((batch, 1, config.hc_mult, hidden), key=mx.random.key(seed))).astype(dtype)
                expected = hc(x)
                y = x.astype(mx.float32)
                mixes = hc._mix(mx.fast.rms_norm(y.flatten(-2), None, hc.norm_eps))
                actual = hc_sinkhorn.hc_sinkhorn_collapse(
                    x, mixes, hc.scale, hc.base, hc.hc_mult, hc.sinkhorn_iters, hc.hc_eps
                )
                tally.compare(f"kernel {backend} seed {seed} {dtype} B={batch}", expected, actual)


def check_layer(tally, dtypes=(mx.bfloat16, mx.float32), batches=(1, 2), lengths=(1, 8), steps=3, hidden=4096):
    """A real-width DecoderLayer, stock against patched, over a few decode steps (or short blocks)."""
    from mlx_vlm.models.cache import ArraysCache

    stock = stock_layer_call()
    for dtype in dtypes:
        layer, config = real_width_layer(dtype, hidden=hidden)
        for batch, length in ((b, n) for b in batches for n in lengths):
            inputs = [
                mx.random.normal((batch, length, config.hc_mult, hidden), key=mx.random.key(50 + s)).astype(dtype)
                for s in range(steps)
            ]
            expected, cache = [], ArraysCache(size=2)
            for x in inputs:
                expected.append(stock(layer, x, None, cache)[0])
            expected += [a for a in cache.cache]
            for kernel in kernel_modes():
                actual, cache = [], ArraysCache(size=2)
                with _layer.forcing_kernel(kernel), patched_instances([layer]):
                    for x in inputs:
                        actual.append(layer(x, None, cache)[0])
                actual += [a for a in cache.cache]
                name = f"layer hidden {hidden} {dtype} B={batch} L={length} kernel={'on' if kernel else 'off'}"
                tally.compare(name, expected, actual)


def tiny_language_model(bits=None):
    """The tiny model's language model (``glm53_patches.tiny_model``).

    Where mlx-vlm's ``glm5_next`` package cannot be imported whole (a bare GPU
    machine without its vision/processor dependencies), an unquantized
    ``LanguageModel`` of the same configuration with seeded weights.
    """

    try:
        language_model = tiny_model.build_model(quantize_bits=bits, seed=0).language_model
    except ImportError:
        if bits is not None:
            raise
    else:
        if bits is not None and gpu_backend() == "cuda":
            # MLX's CUDA quantized matmul has no fp32-activation kernel for
            # these small shapes: run it as a real checkpoint is stored, bf16
            # except hyper-connections, A_log, dt_bias (the model's cast predicate).
            from mlx.utils import tree_flatten, tree_unflatten

            keep = language_model.cast_predicate
            language_model.update(
                tree_unflatten(
                    [
                        (path, value.astype(mx.bfloat16) if keep(path) and mx.issubdtype(value.dtype, mx.floating) else value)
                        for path, value in tree_flatten(language_model.parameters())
                    ]
                )
            )
            mx.eval(language_model.parameters())
        return language_model
    config = TextConfig.from_dict(tiny_model.tiny_config()["text_config"])
    language_model = _lang.LanguageModel(config)
    randomize(language_model, mx.random.key(0))
    language_model.eval()
    mx.eval(language_model.parameters())
    return language_model


def check_model(tally, steps=16, quantize=(None, 4)):
    """Greedy decode of the tiny model, stock against patched, logits bit for bit."""
    prompts = {1: mx.array([[3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]])}
    prompts[2] = mx.concatenate([prompts[1], mx.array([[9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13]])])
    for bits in quantize:
        language_model = tiny_language_model(bits)
        for batch, prompt in prompts.items():
            label = f"tiny model {'fp32' if bits is None else f'{bits}-bit'} B={batch}"
            try:
                expected = tiny_model.greedy_logits(language_model, prompt, steps)
            except RuntimeError as exc:  # stock itself cannot run it here: nothing to compare
                tally.notes.append(f"{label} skipped: stock raised {str(exc).splitlines()[0][:120]}")
                continue
            blocks = tiny_model.speculative_outputs(language_model, prompt)
            for kernel in kernel_modes():
                with _layer.forcing_kernel(kernel), patched_instances(language_model.layers):
                    actual = tiny_model.greedy_logits(language_model, prompt, steps)
                    actual_blocks = tiny_model.speculative_outputs(language_model, prompt)
                tally.compare(f"{label} kernel={'on' if kernel else 'off'}", expected, actual)
                tally.compare(f"{label} verify blocks kernel={'on' if kernel else 'off'}", blocks, actual_blocks)


def verify():
    """``{"exact", "max_abs_diff", "cases", "detail"}`` for this machine's backend."""
    start = time.perf_counter()
    tally = Tally()
    check_kernel(tally)
    check_layer(tally)
    check_model(tally)
    return tally.result(time.perf_counter() - start)
