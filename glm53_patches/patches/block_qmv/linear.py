"""The replacements for glm5_next's ``linear`` and ``tiled_linear``: short blocks through ``kernel.block_qmv``.

glm5_next calls every projection as ``linear(module, x)`` or
``tiled_linear(module, x)`` (``mlx_vlm.models.linear``; ``tiled_linear``
hands blocks of up to 256 positions to ``linear``). For 2 to 8 positions
(``DECODE_BLOCK_SIZE``: speculative verify blocks, a short prompt's chunk)
``linear`` calls ``native_batch_linear``, which at batch 1, a 16-bit input
and a width that is a multiple of 512 takes ``singleton_quantized_linear``:
one ``gather_qmm`` over the positions, one row each, plus the module's bias.
Below 8 positions MLX runs that gather as its ``gather_qmv`` kernel, qmv's
arithmetic per position (on Metal its fast variant, where the rows are a
multiple of 8). At other widths it takes ``exact_quantized_linear``: each
position as its own one-row call, which MLX's CUDA backend runs as ``qmv``
where a row holds more than one group (KDA's ``f_b_proj`` and ``g_b_proj``,
128 wide), at any block length. ``kernel.block_qmv`` gives the same bits
and reads the weights once. Every other call (one token, prefill, 8
positions on the gather path, a batch, other modules, dtypes or widths, no
GPU, not verified here) goes to the function that was installed before,
counted by reason where it was a block.
"""

import functools
from typing import Optional

import mlx.nn as nn
from mlx_vlm.models.linear import DECODE_BLOCK_SIZE

from glm53_patches.backend import gpu_backend
from glm53_patches.kernel_switch import KernelSwitch
from glm53_patches.patches.exact_qmv import kernel as qmv_kernel

from . import PATCH
from . import kernel

stats = PATCH.stats
switch = KernelSwitch(PATCH.name, backends=("cuda", "metal"))
MAX_POSITIONS = 7  # gather_qmm takes gather_qmv below 8 (M * batch < 8); its tiled GEMM at 8


def unsupported(module, x, backend="cuda") -> Optional[str]:
    """Why stock's ``linear(module, x)`` for a block ``x`` of ``[B, L, K]`` is not a call the kernel
    reproduces on ``backend``, or None."""
    if type(module) is not nn.QuantizedLinear:
        return "module type"
    if x.shape[0] != 1:
        return "batch"  # stock: exact_quantized_linear, another path
    if module.mode != "affine" or module.bits not in qmv_kernel.BITS or module.group_size not in qmv_kernel.GROUPS:
        return "quantization"
    if x.dtype not in qmv_kernel.DTYPES or module["scales"].dtype != x.dtype or module["biases"].dtype != x.dtype:
        return "dtype"
    K = x.shape[-1]
    if module["weight"].ndim != 2 or module["weight"].shape[1] * 32 != K * module.bits:
        return "shape"
    if K % 512 == 0:  # native_batch_linear's singleton path: one gather_qmm over the positions
        if x.shape[1] > MAX_POSITIONS:
            return "positions"
    elif backend != "cuda" or K <= module.group_size:
        # else one call per position: CUDA's qmv at one row, but MLX's sm90 GEMM where a row is one
        # group, and on Metal a qmv variant the twin does not mirror
        return "width"
    if backend == "metal" and module["weight"].shape[0] % 8:
        return "rows"  # Metal's gather_qmv_fast wants them a multiple of 8; its plain gather_qmv has another order
    return None


def project(module, x):
    """``linear(module, x)`` for a short block through the kernel, or None (nothing built) where the
    installed function must run."""
    if x.ndim != 3 or not 1 < x.shape[1] <= DECODE_BLOCK_SIZE or getattr(module, "training", False):
        return None  # one token, prefill, training: not counted, they are not this patch's calls
    backend = gpu_backend()
    if backend is None:
        stats.fallback("no GPU")
        return None
    if not switch.wanted(backend):
        stats.fallback("kernel off (not verified here)")
        return None
    if backend == "metal" and kernel.metal_header() is None:
        stats.fallback("no MLX Metal headers")  # the twin calls MLX's own qdot, read from them
        return None
    reason = unsupported(module, x, backend)
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit("kernel")
    # squeeze, not x[0]: MLX indexes with an integer through `take`, a Gather kernel per projection
    out = kernel.block_qmv(x.squeeze(0), module["weight"], module["scales"], module["biases"], module.bits,
                           module.group_size, backend=backend)[None]
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
