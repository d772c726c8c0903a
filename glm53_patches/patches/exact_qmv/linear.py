"""The replacements for glm5_next's ``linear`` and ``tiled_linear``: decode projections through ``kernel.qmv``.

glm5_next calls every projection as ``linear(module, x)`` or
``tiled_linear(module, x)`` (``mlx_vlm.models.linear``). At a decode step
(``x`` of ``[B, 1, K]``) both come down to ``module(x)``, which for an
``nn.QuantizedLinear`` is ``mx.quantized_matmul(x, weight, scales, biases,
transpose=True, ...)`` plus its bias, if it has one. On CUDA, with fewer than
8 rows, MLX runs that as its ``qmv`` kernel; ``kernel.qmv`` computes the same
bits faster. Every other call (prefill, speculative verify blocks, 8 or more
rows, other modules, dtypes or widths, no CUDA, not verified here) goes to the
function that was installed before, counted by reason.
"""

import functools
from typing import Optional

import mlx.nn as nn

from glm53_patches.backend import gpu_backend
from glm53_patches.kernel_switch import KernelSwitch

from . import PATCH
from . import kernel

stats = PATCH.stats
switch = KernelSwitch(PATCH.name, backends=("cuda",))
MAX_ROWS = 7  # MLX's quantized_matmul takes qmv below 8 rows (M * batch < 8)
# Widths where the kernel beat MLX's qmv on an H200: the ones MLX packs across bytes (PATCH.md).
# At 2, 4 and 8 bits qmv loads whole arrays and was as fast or faster, so stock runs there.
TAKES_BITS = (3, 5, 6)


def unsupported(module, x) -> Optional[str]:
    """Why ``module(x)`` is not a call the kernel reproduces, or None."""
    if type(module) is not nn.QuantizedLinear:
        return "module type"
    if module.mode != "affine" or module.bits not in kernel.BITS or module.group_size not in kernel.GROUPS:
        return "quantization"
    if module.bits not in TAKES_BITS:
        return f"{module.bits}-bit (stock's qmv is as fast)"
    if x.dtype not in kernel.DTYPES or module["scales"].dtype != x.dtype or module["biases"].dtype != x.dtype:
        return "dtype"
    K = x.shape[-1]
    if module["weight"].ndim != 2 or module["weight"].shape[1] * 32 != K * module.bits:
        return "shape"
    if K <= module.group_size:
        return "width"  # a single group per row can take MLX's sm90 GEMM at one row: not qmv
    if x.size // K > MAX_ROWS:
        return "rows"
    return None


def project(module, x):
    """``module(x)`` through the kernel, or None (nothing built) where the installed function must run."""
    if x.ndim != 3 or x.shape[1] != 1:
        return None  # prefill and verify blocks: not counted, they are not this patch's calls
    if gpu_backend() != "cuda":
        stats.fallback("not CUDA")
        return None
    if not switch.wanted("cuda"):
        stats.fallback("kernel off (not verified here)")
        return None
    reason = unsupported(module, x)
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit("kernel")
    out = kernel.qmv(x, module["weight"], module["scales"], module["biases"], module.bits, module.group_size)
    if "bias" in module:
        out = out + module["bias"]
    return out


def _replacement(original):
    @functools.wraps(original)
    def replacement(module, x):
        out = project(module, x)
        return original(module, x) if out is None else out

    return replacement


make_linear = make_tiled_linear = _replacement  # the same wrapper for both: each hands the rest to its original


def clear():
    switch.clear()
