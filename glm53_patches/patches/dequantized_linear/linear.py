"""The replacement for glm5_next's ``linear``: prefill projections as dequantize + matmul.

At prefill glm5_next calls ``linear(module, x)`` with a whole chunk (``x`` of
``[B, L, K]``, ``L`` above ``DECODE_BLOCK_SIZE``), which comes down to
``module(x)``: for an ``nn.QuantizedLinear``, ``mx.quantized_matmul(x, weight,
scales, biases, transpose=True, ...)`` plus its bias. On CUDA that is MLX's
quantized GEMM; dequantizing the weight once and handing it to the ordinary
matmul was 1.9-5.3x faster per projection on an H200 at 2,048 rows and gave
the same bits within the envelope ``unsupported`` keeps (PATCH.md). Whether the bits are the same is the backend's business, so the
swap runs only where ``verify`` passed (or the knob forces it), and only for the
activation dtypes verify covers there. Every other call goes to the function
that was installed before, counted by reason where it is a prefill call.
"""

import functools

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models import linear as _linear

from glm53_patches import config
from glm53_patches.backend import current as backend
from glm53_patches.kernel_switch import KernelSwitch

from . import PATCH

stats = PATCH.stats
# GLM53_DEQUANTIZED_LINEAR_FAST_PATH. `auto` runs it on CUDA only: on the CPU it was slower than
# quantized_matmul (it runs there when forced, for the tests), and on Metal it is unmeasured.
switch = KernelSwitch(PATCH.name, backends=("cuda", "metal", "cpu"), knob="fast_path", auto_backends=("cuda",))
# The activation dtypes `verify` checks on each backend. The CPU's half-precision matmul rounds
# differently from its quantized_matmul (a measured difference), so there it is float32 only.
DTYPES = {"cpu": (mx.float32,), "cuda": (mx.bfloat16, mx.float16), "metal": (mx.bfloat16, mx.float16)}
# Below 1,024 rows CUDA's bf16 GEMM can split K, and then its bits differ from quantized_matmul's
# (H200, s30: DSA o_proj 4096x16384 at 256 and 300 rows, fbg_a_proj at 256 and 300; PATCH.md).
DEFAULT_MIN_TOKENS = 1024
# The narrowest projection (outputs, inputs) it takes on CUDA, H200, s30: 32 outputs (the indexer's
# weights_proj) differed at every row count; 128 inputs (KDA f_b / g_b_proj) made dequantizing cost
# more than it saved (g_b_proj at 2,048 rows: 0.78x). No limit where unmeasured.
NARROWEST = {"cuda": (256, 1024)}
# GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS: the fewest rows (batch x tokens) a call dequantizes for.
min_tokens = config.CachedKnob(PATCH, "min_tokens", DEFAULT_MIN_TOKENS)


def unsupported(module, x, here):
    """Why ``module(x)`` on backend ``here`` stays on stock's path (None: it dequantizes)."""
    if type(module) is not nn.QuantizedLinear:
        return "not a QuantizedLinear"
    if module.mode != "affine" or "biases" not in module:
        return "not affine-quantized"
    if x.dtype not in DTYPES.get(here, ()) or module["scales"].dtype != x.dtype:
        return "dtype"  # unverified here, or a mixed call quantized_matmul would promote
    if x.size // x.shape[-1] < min_tokens():  # the GEMM's rows: MLX folds the batch into them
        return "chunk below GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS"
    out_dims, in_dims = NARROWEST.get(here, (0, 0))
    if module["weight"].shape[0] < out_dims or x.shape[-1] < in_dims:
        return "narrow projection"
    return None


def project(module, x):
    """``module(x)`` as dequantize + matmul, or None (nothing built) where the installed function must run."""
    if x.ndim != 3 or x.shape[1] <= _linear.DECODE_BLOCK_SIZE:
        return None  # decode steps and speculative blocks: not this patch's calls, not counted
    here = backend()
    if not switch.wanted(here):
        stats.fallback("off on this backend (GLM53_DEQUANTIZED_LINEAR_FAST_PATH)")
        return None
    reason = unsupported(module, x, here)
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit("dequantized")
    weight = mx.dequantize(module["weight"], module["scales"], module["biases"],
                           group_size=module.group_size, bits=module.bits)
    out = x @ weight.T
    if "bias" in module:
        out = out + module["bias"]
    return out


def make_linear(original):
    @functools.wraps(original)
    def linear(module, x):
        out = project(module, x)
        return original(module, x) if out is None else out

    return linear


def clear():
    switch.clear()
    min_tokens.clear()
