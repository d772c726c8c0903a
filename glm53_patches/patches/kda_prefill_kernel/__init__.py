"""kda_prefill_kernel: KDA prefill off Metal in one CUDA kernel, or chunked.

Stock KDA prefill on CPU and CUDA loops over tokens (``gated_delta_ops``);
this runs the same gated delta rule in one kernel launch on CUDA
(``cuda.py``) and chunk by chunk with matmuls elsewhere (``chunked.py``).
``mixer.py`` is the mixer wrapper. All are imported on first use, so
discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

NAME = "kda_prefill_kernel"
_CACHE = "mlx_vlm.models.cache:ArraysCache"
_GATED = "mlx_vlm.models.gated_delta"


PATCH = Patch(
    name=NAME,
    summary=(
        "Prefill (length > 1) of Glm5NextLinearAttention (KDA) off Metal runs the "
        "gated delta rule in one kernel launch on CUDA, and in chunks of C tokens "
        "with matmuls (WY/UT transform) on the CPU, instead of stock's per-token "
        "loop; float32 like stock, not bit-identical."
    ),
    targets={f"{GLM5_NEXT}:Glm5NextLinearAttention.__call__": lazy(f"{__name__}.mixer", "make_call")},
    prefill_only=True,  # a decode step's single token is handed on untouched
    relies_on=(
        f"{GLM5_NEXT}:Glm5NextLinearAttention.__init__",
        f"{GLM5_NEXT}:ShortConv1d.__init__",
        f"{GLM5_NEXT}:ShortConv1d.__call__",
        "mlx_vlm.models.linear:linear",
        f"{_GATED}:gated_delta_update",
        f"{_GATED}:compute_g_safe",
        f"{_GATED}:gated_delta_ops",
        f"{_GATED}:_gated_delta_step_ops",
        f"{_CACHE}.update_recurrent",
        f"{_CACHE}.update_window",
        f"{_CACHE}.advance",
        f"{_CACHE}.make_mask",
    ),
    uses=("glm53_patches.kernels.build",),
    numerics="changing",
    needs_verify_on=(),  # no hand-written kernels; plain MLX ops
    upstream="not yet proposed: a chunked gated_delta_ops for vectorized gates (PATCH.md)",
    on_revert=lazy(f"{__name__}.mixer", "clear", only_if_loaded=True),
    knobs={
        "method": config.choice("auto", "kernel", "chunked", doc="auto (the default): the CUDA kernel on CUDA, the chunked form elsewhere"),
        "chunk": config.choice(16, 32, 64, 128, doc="the chunked form's chunk length (default 16)"),
    },
)


@hookimpl
def glm53_patches():
    return [PATCH]
