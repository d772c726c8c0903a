"""The replacements for ``MoE.__call__`` and ``QuantizedSwitchLinear.__call__``: glm5_next's routed experts
through ``kernel.expert_mma`` at decode and in verify blocks.

mlx-vlm's ``SwitchGLU`` computes a MoE block's routed experts as three
``QuantizedSwitchLinear`` calls, each one ``gather_qmm`` with one row per
route: at decode (``[B, 1, H]``) over the B x 8 routes, in a verify block
(through ``quantized_verifier.exact_quantized_switch_linear`` and
``exact_quantized_selected_linear``) over the block's B x L x 8. Both classes
are shared by every mlx-vlm model, so the ``MoE.__call__`` wrapper marks the
calls made inside a ``Glm5NextMoE`` where the kernel is wanted on CUDA (a
thread-local depth; it runs before expert_combine's and the prefill patches'
wrappers of the same method, which call the ``SwitchGLU`` themselves;
elsewhere it counts the block once, by reason), and the projection wrapper
takes only those, where stock's ``gather_qmm`` runs ``qmm_sm80``
(``unsupported``). Every other call goes to the installed function; a marked
one is counted by reason. A decode step's gate and up, one input for both,
go to the kernel together, in one launch (the ``SwitchGLU.__call__``
wrapper, ``cuda_decode``); its down projection, and every projection of a
verify block, come through the projection wrapper.

On Metal the ``SwitchGLU.__call__`` wrapper takes a marked decode step's
routed experts whole (``unsupported_on_metal``): gate and up through
``kernel.expert_qmv`` in one dispatch, stock's own activation, then down,
each with the Metal ``gather_qmv`` arithmetic stock's calls get. Each such
block is counted once there, by reason where it goes to stock; the projection
wrapper leaves Metal calls alone.
"""

import functools
import math
import threading
from typing import Optional

import mlx.core as mx
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.switch_layers import QuantizedSwitchLinear

from glm53_patches.backend import gpu_backend
from glm53_patches.kernel_switch import KernelSwitch

from . import PATCH
from . import kernel

stats = PATCH.stats
switch = KernelSwitch(PATCH.name, backends=("cuda", "metal"))
MIN_ROUTES = 8  # below 8 routes (M x B < 8) MLX runs gather_qmv, qmv's arithmetic, not qmm_sm80's
_inside = threading.local()  # .depth: Glm5NextMoE calls in progress on this thread


def routes_per_row(x_batch, batch) -> Optional[int]:
    """How many consecutive routes of ``batch`` (the call's broadcast batch shape) share one input row
    of ``x_batch`` (the input's batch shape), or None where its rows do not map onto runs of routes."""
    x_batch = (1,) * (len(batch) - len(x_batch)) + tuple(x_batch)
    for kept in range(len(batch) + 1):  # the input follows the first `kept` dims, broadcasts the rest
        if x_batch[:kept] == tuple(batch[:kept]) and all(d == 1 for d in x_batch[kept:]):
            return math.prod(batch[kept:])
    return None


def unsupported(module, x, indices, sorted_indices) -> Optional[str]:
    """Why stock's ``module(x, indices)`` is not a call the kernel reproduces, or None."""
    if (module.mode != "affine" or module.bits != kernel.BITS or module.group_size != kernel.GROUP
            or module.get("biases") is None):
        return "quantization"
    if "bias" in module:
        return "bias"
    if x.dtype != mx.bfloat16 or module["scales"].dtype != x.dtype or module["biases"].dtype != x.dtype:
        return "dtype"
    if sorted_indices:
        return "sorted"  # a batch of 8 or more sequences: stock sorts the routes first
    if x.ndim < 2 or x.shape[-2] != 1:
        return "rows"  # prefill: several rows per route
    weight = module["weight"]
    if weight.ndim != 3 or weight.shape[-1] * 32 != x.shape[-1] * kernel.BITS:
        return "shape"
    if weight.shape[-2] % 128 or x.shape[-1] % 64:
        return "shape"  # qmm_sm80's tile; stock runs another kernel
    if x.shape[-1] % kernel.STEP or x.shape[-1] > kernel.MAX_K:
        return "shape"  # the kernel reads 4 groups a step and holds the input in shared memory
    batch = mx.broadcast_shapes(x.shape[:-2], indices.shape)
    if math.prod(batch) < MIN_ROUTES:
        return "routes"
    if tuple(indices.shape) != tuple(batch) or routes_per_row(x.shape[:-2], batch) is None:
        return "broadcast"  # the kernel takes one index per route, and the input's rows in runs of routes
    return None


def project(module, x, indices, sorted_indices):
    """``module(x, indices)`` through the kernel, or None (nothing built) where the installed function must run."""
    if not getattr(_inside, "depth", 0):
        return None  # not a glm5_next MoE's call: not this patch's to count
    backend = gpu_backend()
    if backend == "metal":
        return None  # the SwitchGLU wrapper took this block or counted why not
    if backend != "cuda":
        stats.fallback("no CUDA")
        return None
    if not switch.wanted(backend):
        stats.fallback("kernel off (not verified here)")
        return None
    reason = unsupported(module, x, indices, sorted_indices)
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit("kernel")
    out, = kernel.expert_mma(x.reshape(-1, x.shape[-1]), indices.reshape(-1).astype(mx.uint32), [tensors(module)])
    return out.reshape(*indices.shape, 1, out.shape[-1])  # unsupported: the indices' shape is the batch


def tensors(module):
    return module["weight"], module["scales"], module["biases"]


def make_projection_call(original):
    @functools.wraps(original)
    def __call__(self, x, indices, sorted_indices=False):
        out = project(self, x, indices, sorted_indices)
        return original(self, x, indices, sorted_indices=sorted_indices) if out is None else out

    return __call__


def make_moe_call(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        if not isinstance(self, _lang.Glm5NextMoE):
            return original(self, *args, **kwargs)
        # decided once per block here, so that off CUDA and Metal its projections pay one attribute lookup each
        backend = gpu_backend()
        if backend not in switch.backends or not switch.wanted(backend):
            stats.fallback("no CUDA or Metal" if backend not in switch.backends else "kernel off (not verified here)")
            return original(self, *args, **kwargs)
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _inside.depth -= 1

    return __call__


METAL_BITS = (2, 3, 4, 5, 6, 8)  # what qmv_fast_impl's load_vector and qdot take (1-bit has a tail block)


def unsupported_on_metal(glu, x, indices) -> Optional[str]:
    """Why stock's ``glu(x, indices)`` on Metal is not a decode step whose three projections all run
    ``affine_gather_qmv_fast`` as the twin does, or None."""
    if glu.training or x.ndim != 3 or x.shape[1] != 1 or indices.shape[:-1] != x.shape[:-1]:
        return "not a decode step"  # prefill, and verify blocks (stock's own exact block path)
    if indices.size >= 64:
        return "sorted"  # 8 or more sequences: stock sorts the routes first
    gate, up, down = glu.gate_proj, glu.up_proj, glu.down_proj
    for module in (gate, up, down):
        if not isinstance(module, QuantizedSwitchLinear) or module.mode != "affine" or module.get("biases") is None:
            return "quantization"
        if module.bits not in METAL_BITS or module.group_size not in (32, 64, 128):
            return "quantization"
        if "bias" in module:
            return "bias"
        if module["scales"].dtype != x.dtype or module["biases"].dtype != x.dtype:
            return "dtype"
        if module["weight"].ndim != 3 or module["weight"].shape[-2] % 8 or module.input_dims % 512:
            return "shape"  # gather_qmv_fast's shapes; stock runs gather_qmv
    if x.dtype not in (mx.bfloat16, mx.float16):
        return "dtype"
    if (gate.bits, gate.group_size, gate["weight"].shape) != (up.bits, up.group_size, up["weight"].shape):
        return "gate and up differ"
    return None


def cuda_decode(glu, x, indices):
    """A marked decode step's routed experts on CUDA with gate and up in one launch of the kernel, then stock's
    activation and down projection (which the projection wrapper takes), shaped as stock's before ``_combine``;
    or None where the installed function must run (its projections are then offered one by one)."""
    if glu.training or x.ndim != 3 or x.shape[1] != 1:
        return None  # prefill and verify blocks: stock's own paths call the projections
    gate, up = glu.gate_proj, glu.up_proj
    if not (isinstance(gate, QuantizedSwitchLinear) and isinstance(up, QuantizedSwitchLinear)):
        return None
    x = mx.expand_dims(x, (-2, -3))  # as stock's: [B, 1, 1, 1, H] against the routes' [B, 1, top_k]
    sort = indices.size >= 64
    if (unsupported(gate, x, indices, sort) or unsupported(up, x, indices, sort)
            or gate["weight"].shape != up["weight"].shape):
        return None  # the projection wrapper counts why, call by call
    stats.hit("kernel")
    x_up, x_gate = kernel.expert_mma(x.reshape(-1, x.shape[-1]), indices.reshape(-1).astype(mx.uint32),
                                     [tensors(up), tensors(gate)])
    activated = glu.activation(x_up, x_gate).reshape(*indices.shape, 1, x_up.shape[-1])
    return glu.down_proj(activated, indices).squeeze(-2)


def metal_decode(glu, x, indices):
    """A marked decode step's routed experts on Metal through the twin, shaped as stock's before
    ``_combine`` (``[..., top_k, hidden]``), or None where the installed function must run."""
    reason = unsupported_on_metal(glu, x, indices)
    if reason is None and kernel.metal_header() is None:
        reason = "no MLX Metal headers"  # the twin calls MLX's own qdot, read from them
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit("metal twin")
    routes = indices.reshape(-1).astype(mx.uint32)
    gate, up, down = glu.gate_proj, glu.up_proj, glu.down_proj
    x_up, x_gate = kernel.expert_qmv(x.reshape(-1, x.shape[-1]), routes, [tensors(up), tensors(gate)],
                                     up.bits, up.group_size)
    out, = kernel.expert_qmv(glu.activation(x_up, x_gate), routes, [tensors(down)], down.bits, down.group_size)
    return out.reshape(*indices.shape, out.shape[-1])


def decode_step(glu, x, indices):
    """``glu(x, indices)``'s routed outputs before ``_combine`` where this backend's path takes a marked
    decode step whole, or None."""
    if not getattr(_inside, "depth", 0):
        return None
    backend = gpu_backend()
    return cuda_decode(glu, x, indices) if backend == "cuda" else (
        metal_decode(glu, x, indices) if backend == "metal" else None)


def make_glu_call(original):
    @functools.wraps(original)
    def __call__(self, x, indices, weights=None, shared=None, residual=None):
        routed = decode_step(self, x, indices)
        if routed is None:
            return original(self, x, indices, weights=weights, shared=shared, residual=residual)
        return self._combine(routed, weights, shared, residual)

    return __call__


def clear():
    switch.clear()
