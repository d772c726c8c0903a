"""How latent_prefill becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream module is generated from ``attend.py``
itself (see ``glm53_patches/stage/source.py`` for the rules).
"""

TITLE = "glm5_next: DSA prefill off Metal in the latent space, as decode (MLX_VLM_GLM5_LATENT_PREFILL)"

# Off by default upstream: `MLX_VLM_GLM5_LATENT_PREFILL=1` turns it on.
SWITCH = "MLX_VLM_GLM5_LATENT_PREFILL"

MODULES = {"attend": "mlx_vlm/models/glm5_next/latent_prefill.py"}

PLUGIN_ONLY = ("make_attend",)

HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "Glm5NextAttention._attend",
        "import": "from . import latent_prefill",
        "code": (
            "if latent_prefill.ENABLED:\n"
            "    result = latent_prefill.prefill_attend(self, q, latent, topk, kv_cache, last_only)\n"
            "    if result is not None:\n"
            "        return result\n"
        ),
    },
)

FAST_PATH = "mlx_vlm.models.glm5_next.latent_prefill:prefill_attend"

TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_latent_prefill.py"}

PR_SECTIONS = (
    ("Why and how", ("Why", "How")),
    ("Numerics (not bit-identical: quality measured)", ("Numerics and the gate",)),
    ("Measured effect", ("Measured",)),
)
