"""How gathered_prefill becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream module is generated from ``attention.py``
itself (see ``glm53_patches/stage/source.py`` for the rules).
"""

TITLE = "glm5_next: sparse prefill attention off Metal without per-chunk K/V copies (MLX_VLM_GLM5_GATHERED_PREFILL)"

SWITCH = "MLX_VLM_GLM5_GATHERED_PREFILL"

MODULES = {"attention": "mlx_vlm/models/glm5_next/gathered_prefill.py"}

PLUGIN_ONLY = ("NAME", "make_sparse_prefill", "report")

# The two settings read MLX_VLM_* variables upstream instead of glm53_patches.config.
REPLACE = {
    "min_context": '''
def min_context():
    """MLX_VLM_GLM5_GATHERED_PREFILL_MIN_CONTEXT: keys below which stock runs (read per call)."""
    return int(os.environ.get("MLX_VLM_GLM5_GATHERED_PREFILL_MIN_CONTEXT", default_min_context()))
''',
    "element_budget": '''
def element_budget():
    """MLX_VLM_GLM5_GATHERED_PREFILL_MAX_ELEMENTS: elements per gathered K (or V) and chunk.

    Default on a GPU: 2^31 - 1 (4.3 GB per gathered tensor in bf16, twice
    that for K and V together); on the CPU: ``CPU_ELEMENTS``.
    """
    default = MAX_ELEMENTS if mx.default_device() == mx.gpu else min(CPU_ELEMENTS, MAX_ELEMENTS)
    return min(MAX_ELEMENTS, max(1, int(os.environ.get("MLX_VLM_GLM5_GATHERED_PREFILL_MAX_ELEMENTS", default))))
''',
}

TEXT = {
    "GLM53_GATHERED_PREFILL_MAX_ELEMENTS": "MLX_VLM_GLM5_GATHERED_PREFILL_MAX_ELEMENTS",
    "GLM53_GATHERED_PREFILL_MIN_CONTEXT": "MLX_VLM_GLM5_GATHERED_PREFILL_MIN_CONTEXT",
}

HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "_sparse_prefill_attention",
        "import": "from . import gathered_prefill",
        "code": (
            "if gathered_prefill.ENABLED:\n"
            "    output = gathered_prefill.prefill_attention(q, k, v, indices, scale)\n"
            "    if output is not None:\n"
            "        return output\n"
        ),
    },
)

FAST_PATH = "mlx_vlm.models.glm5_next.gathered_prefill:prefill_attention"

TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_gathered_prefill.py"}

PR_SECTIONS = (
    ("Why and how", ("What it replaces", "What it does", "When it steps aside")),
    ("Why the outputs are bit-identical", ("Exactness",)),
    ("Measured effect", ("Measured",)),
)
