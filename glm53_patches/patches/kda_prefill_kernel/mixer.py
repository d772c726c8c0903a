"""KDA mixer prefill with the gated delta rule in one CUDA kernel, or chunked.

``Glm5NextLinearAttention.__call__`` is replaced by a wrapper that, for
prefill (length > 1) off Metal, runs the stock mixer body op for op and only
swaps its ``gated_delta_update`` call (stock: a per-token loop of compiled
steps) for ``chunked.chunked_gated_delta`` or, on CUDA,
``cuda.kernel_gated_delta`` (one launch for the whole prompt; chosen by
GLM53_KDA_PREFILL_KERNEL_METHOD, see ``method``). Everything else (decode, Metal,
training, speculative history, a mask that is not bool, no gate bound, a
replaced helper) goes to the object it wraps: stock, or another patch such as
compiled_kda_decode, which handles length 1 and passes prefill on.

The wrapper, not the module-level name ``gated_delta_update`` that language.py
imports, is the target: the drift guard fingerprints definitions, and an
imported name has none.
"""

import functools
import logging

import mlx.core as mx

from mlx_vlm.models import gated_delta as _gd
from mlx_vlm.models.glm5_next import language as _lang

from glm53_patches import config
from glm53_patches.backend import gpu_backend
from glm53_patches.log import once

from . import NAME, PATCH
from . import cuda
from .chunked import chunked_gated_delta, log_gate, sub_block

stats = PATCH.stats

DEFAULT_CHUNK = 16  # fastest measured on a 2-core CPU; a GPU likely wants 64


def chunk_size():
    """GLM53_KDA_PREFILL_KERNEL_CHUNK, read per call (cheap) so tests can set it."""
    return config.knob_value(NAME, "chunk", PATCH.knobs["chunk"], DEFAULT_CHUNK)


def method():
    """GLM53_KDA_PREFILL_KERNEL_METHOD resolved for this backend: "kernel" or "chunked".

    auto: the CUDA kernel on CUDA, chunked elsewhere; kernel off CUDA: chunked
    (logged once); an invalid value: logged once, auto.
    """
    choice = config.knob_value(NAME, "method", PATCH.knobs["method"], "auto")
    on_cuda = cuda.cuda_available()
    if choice == "kernel" and not on_cuda:
        once(logging.INFO, "GLM53_KDA_PREFILL_KERNEL_METHOD=kernel: no CUDA device here, using chunked")
    return "kernel" if on_cuda and choice != "chunked" else "chunked"


def _why_not(attn, x, mask):
    """None if the chunked path handles this call, else the fallback reason."""
    if x.shape[1] < 2:
        return "decode (length 1)"
    if attn.training:
        return "training"
    if gpu_backend() == "metal":
        return "metal (stock has a fused kernel)"
    if mask is not None and mask.dtype != mx.bool_:
        return "mask not bool"
    if attn.lower_bound is None:
        return "no gate lower bound"
    if sub_block(chunk_size(), attn.lower_bound) is None:
        return "gate lower bound too large for float32 chunking"
    if _lang.gated_delta_update is not _gd.gated_delta_update:
        return "gated_delta_update replaced"
    return None


def _recurrence(q, k, v, a, b, A_log, dt_bias, lower_bound, mask, state, steps):
    """Stock ``gated_delta_update`` minus the cache plumbing, chunked."""
    if steps is not None:  # the cache wants per-token states (speculation)
        stats.fallback("speculative history")
        return _gd.gated_delta_update(
            q, k, v, a, b, A_log, dt_bias, state=state, mask=mask,
            lower_bound=lower_bound, state_steps=steps,
        )
    log_g, beta = log_gate(A_log, a, dt_bias, lower_bound), mx.sigmoid(b)
    if method() == "kernel":
        result = cuda.kernel_gated_delta(q, k, v, log_g, beta, state, mask)
        if result is not None:
            stats.hit("prefill (cuda kernel)")
            return result
        reason = cuda.unsupported(q, k, v, log_g, beta, state, mask) or "no CUDA"
        stats.fallback(f"cuda kernel: {reason} (chunked instead)")
    stats.hit("prefill (chunked)")
    chunk = chunk_size()
    return chunked_gated_delta(q, k, v, log_g, beta, state, mask, chunk=chunk, sub=sub_block(chunk, lower_bound))


def prefill(self, x, mask=None, cache=None):
    """The stock mixer body (language.py, Glm5NextLinearAttention.__call__)."""
    linear = _lang.linear
    batch, length, _ = x.shape
    if mask is not None and mask.dtype == mx.bool_:
        x = mx.where(mask[..., None], x, 0)
    qkv = self.qkv_conv(linear(self.qkv_proj, x), mask=mask, cache=cache)
    shape = (batch, length, self.num_heads, self.head_dim)
    q, k, v = (value.reshape(shape) for value in mx.split(qkv, 3, axis=-1))
    eps = 1e-6 / self.head_dim
    q = self.scale**2 * mx.fast.rms_norm(q, None, eps)
    k = self.scale * mx.fast.rms_norm(k, None, eps)
    f_a, b, g_a = mx.split(
        linear(self.fbg_a_proj, x),
        (self.head_dim, self.head_dim + self.num_heads),
        axis=-1,
    )
    a = linear(self.f_b_proj, f_a).reshape(shape)
    b = b.reshape(batch, length, self.num_heads)
    args = (
        q, k, v, a, b,
        self.A_log.reshape(self.num_heads, 1),
        self.dt_bias.reshape(self.num_heads, self.head_dim),
        self.lower_bound, mask,
    )
    if cache is None:
        output, _ = _recurrence(*args, None, None)
    else:
        output, _ = cache.update_recurrent(1, length, lambda initial, steps: _recurrence(*args, initial, steps))
        cache.advance(length)
    gate = linear(self.g_b_proj, g_a).reshape(shape)
    output = (self.o_norm(output) * mx.sigmoid(gate)).reshape(batch, length, -1)
    return linear(self.o_proj, output)


def prefill_call(self, x, mask=None, cache=None):
    """``self(x, mask, cache)`` with the chunked or kernel recurrence; None, having touched nothing, elsewhere."""
    reason = _why_not(self, x, mask)
    if reason is not None:
        stats.fallback(reason)
        return None
    return prefill(self, x, mask, cache)


def make_call(original):
    """The replacement for ``Glm5NextLinearAttention.__call__``."""

    @functools.wraps(original)
    def __call__(self, x, mask=None, cache=None):
        output = prefill_call(self, x, mask, cache)
        return original(self, x, mask, cache) if output is None else output

    return __call__


def clear():
    cuda.clear()
