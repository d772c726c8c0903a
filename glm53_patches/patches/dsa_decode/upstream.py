"""How dsa_decode becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream module is generated from ``indexer.py``
itself (see ``glm53_patches/stage/source.py`` for the rules).
"""

TITLE = "glm5_next: indexer decode without context-sized bookkeeping (MLX_VLM_GLM5_DSA_DECODE)"

# Off by default upstream: `MLX_VLM_GLM5_DSA_DECODE=1` turns it on.
SWITCH = "MLX_VLM_GLM5_DSA_DECODE"

MODULES = {
    "decode": "mlx_vlm/models/glm5_next/dsa_decode.py",
    "select_kernel": "mlx_vlm/models/glm5_next/dsa_select_kernel.py",
}

PLUGIN_ONLY = ("make_call", "make_attend")

# The plugin runs the selection kernel where `glm53-patches verify dsa_decode`
# passed on the user's machine; upstream has no verify records: the kernel runs
# on CUDA, where it was checked, whenever the module is switched on.
REPLACE = {
    "kernel_wanted": '''
def kernel_wanted(backend):
    """The selection kernel runs on CUDA (checked bit-identical there); elsewhere the compiled path."""
    return backend == "cuda"
''',
    "gpu_backend": '''
def gpu_backend():
    """'cuda' or 'metal' when the default device is a GPU, else None."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else None
''',
}

TEXT = {
    "glm53_dsa_select": "glm5_next_dsa_select",
    "``glm53-patches verify dsa_decode``": "the tests on a GPU",
    "GLM53_DSA_DECODE_KERNEL, else this backend's verify record (glm53_patches/kernel_switch.py).": "Whether the selection kernel runs on ``backend``.",
}

HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "Glm5NextIndexer.__call__",
        "import": "from . import dsa_decode",
        "code": (
            "if dsa_decode.ENABLED:\n"
            "    topk = dsa_decode.decode_topk(self, x, q_resid, padding_mask, cache, pool_cache, offset)\n"
            "    if topk is not None:\n"
            "        return topk\n"
        ),
    },
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "Glm5NextAttention._attend",
        "import": "from . import dsa_decode",
        "code": (
            "if dsa_decode.ENABLED:\n"
            "    result = dsa_decode.decode_attend(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only)\n"
            "    if result is not None:\n"
            "        return result\n"
        ),
    },
)

FAST_PATH = "mlx_vlm.models.glm5_next.dsa_decode:decode_topk"

TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_dsa_decode.py"}

PR_SECTIONS = (
    ("Why and how", ("What it replaces", "When it steps aside")),
    ("Why the outputs are bit-identical", ("Why it is exact",)),
    ("Measured effect", ("Measured",)),
)
