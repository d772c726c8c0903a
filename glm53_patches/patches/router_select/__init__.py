"""router_select: the MoE router's top-k selection and weights in one GPU launch.

The kernels live in ``kernel.py``, the replacement ``MoEGate.__call__`` in
``gate.py`` and the exactness checks in ``verify.py``; all are imported on
first use, so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

PATCH = Patch(
    name="router_select",
    summary=(
        "MoEGate: after stock's gate matmul, sigmoid, correction bias, top-k (in the order "
        "the backend's argpartition returns), weight normalisation and scaling run as one "
        "kernel launch instead of ~6. GPU only, where `glm53-patches verify router_select` "
        "passed; bit-identical to stock there."
    ),
    targets={f"{GLM5_NEXT}:MoEGate.__call__": lazy(f"{__name__}.gate", "make_call")},
    relies_on=(
        f"{GLM5_NEXT}:_expert_select",
        f"{GLM5_NEXT}:MoEGate.__init__",
        "mlx_vlm.models.linear:tiled_linear",
        "mlx_vlm.models.linear:tokenwise",  # a CUDA block's logits as one batched gemv (kernels/rowwise.py)
    ),
    uses=("glm53_patches.kernels.build", "glm53_patches.kernels.rowwise"),
    numerics="exact",
    needs_verify_on=("cuda", "metal"),
    kernels_on=("cuda", "metal"),
    upstream="not yet proposed: a fused _expert_select kernel for n_group == 1 (PATCH.md)",
    on_revert=lazy(f"{__name__}.gate", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its GPU kernel: where `verify` passed (auto, the default), always (1), never (0); the CPU has none")},
)


@hookimpl
def glm53_patches():
    return [PATCH]
