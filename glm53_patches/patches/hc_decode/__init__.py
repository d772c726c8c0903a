"""hc_decode: a decoder layer's hyper-connections at single-token decode, fused.

The implementation lives in ``layer.py`` (the replacement ``__call__``), the
kernels in ``glm53_patches/kernels/hc_sinkhorn.py`` and the exactness checks in
``verify.py``; all are imported on first use, so discovering this plugin
imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_HC = "mlx_vlm.models.deepseek_v4.hyper_connection"


PATCH = Patch(
    name="hc_decode",
    summary=(
        "Decode of a DecoderLayer (one token, or a speculative verify block of up to 8 "
        "off Metal) runs each hyper-connection's "
        "collapse (flatten, rms_norm, mix matmul, Sinkhorn, weighted sum), the "
        "branch input norm and the expand as mx.compile'd graphs; on a GPU "
        "where `glm53-patches verify` passed, the Sinkhorn collapse is one "
        "kernel launch instead of ~80. Bit-identical to stock."
    ),
    targets={f"{GLM5_NEXT}:DecoderLayer.__call__": lazy(f"{__name__}.layer", "make_call")},
    relies_on=(
        f"{GLM5_NEXT}:DecoderLayer.__init__",
        f"{GLM5_NEXT}:Glm5NextTextModel.__call__",
        f"{_HC}:HyperConnection.__init__",
        f"{_HC}:HyperConnection.apply_branch",
        f"{_HC}:HyperConnection.__call__",
        f"{_HC}:HyperConnection._mix",
        f"{_HC}:_hc_ops",
        f"{_HC}:_hc_split_sinkhorn_ops",
        f"{_HC}:_hc_kernel",
        f"{_HC}:_make_hc_sinkhorn_collapse_kernel",
        f"{_HC}:hc_expand",
        f"{_HC}:_hc_expand_op",
        # short blocks: stock's exact ones are Metal kernels; the MoE takes the residual
        "mlx_vlm.models.fast_ops:exact_hc_norm",
        "mlx_vlm.models.fast_ops:exact_hc_normalized_norm",
        "mlx_vlm.models.fast_ops:exact_hc_expand",
        "mlx_vlm.models.switch_layers:MoE.__call__",
        # a CUDA block's mix matmuls as one batched gemv (kernels/rowwise.py)
        "mlx_vlm.models.linear:tokenwise",
    ),
    uses=("glm53_patches.kernels.hc_sinkhorn", "glm53_patches.kernels.build", "glm53_patches.kernels.rowwise"),
    numerics="exact",
    # The CUDA and Metal kernels run only where `glm53-patches verify` passed
    # (or with GLM53_HC_DECODE_KERNEL=1); the compiled path runs elsewhere.
    needs_verify_on=("cuda", "metal"),
    kernels_on=("cuda", "metal"),
    upstream="not yet proposed: opt-in fused hyper-connection decode layer with a CUDA Sinkhorn kernel (MLX_VLM_GLM5_HC_DECODE)",
    on_revert=lazy(f"{__name__}.layer", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its GPU Sinkhorn kernel: where `verify` passed (auto, the default), always (1), never (0); the CPU has none")},
)


@hookimpl
def glm53_patches():
    return [PATCH]
