"""How kda_prefill_kernel becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream modules are generated from ``mixer.py``
and ``chunked.py`` themselves (see ``glm53_patches/stage/source.py``).
"""

TITLE = "glm5_next: KDA prefill off Metal in one CUDA kernel, or chunked (MLX_VLM_GLM5_KDA_PREFILL_CHUNKED)"

SWITCH = "MLX_VLM_GLM5_KDA_PREFILL_CHUNKED"

# The first module gets ENABLED.
MODULES = {
    "mixer": "mlx_vlm/models/glm5_next/kda_prefill.py",
    "chunked": "mlx_vlm/models/glm5_next/kda_chunked.py",
    "cuda": "mlx_vlm/models/glm5_next/kda_cuda.py",
}

PLUGIN_ONLY = ("make_call", "clear")

REPLACE = {
    "chunk_size": '''
def chunk_size():
    """MLX_VLM_GLM5_KDA_PREFILL_CHUNK: tokens per chunk, one of 16, 32, 64, 128 (default 16)."""
    chunk = int(os.environ.get("MLX_VLM_GLM5_KDA_PREFILL_CHUNK", DEFAULT_CHUNK))
    return chunk if chunk in _CHUNKS else DEFAULT_CHUNK
''',
    "method": '''
def method():
    """MLX_VLM_GLM5_KDA_PREFILL_METHOD: auto (the CUDA kernel on CUDA, chunked elsewhere), kernel or chunked."""
    choice = os.environ.get("MLX_VLM_GLM5_KDA_PREFILL_METHOD", "auto").strip().lower()
    return "kernel" if cuda.cuda_available() and choice != "chunked" else "chunked"
''',
}

# The module docstring speaks of the plugin's wrapper; upstream, __call__ asks first.
TEXT = {
    "``Glm5NextLinearAttention.__call__`` is replaced by a wrapper that, for\n":
        "``Glm5NextLinearAttention.__call__`` first calls ``prefill_call``, which, for\n",
    "``chunked.chunked_gated_delta``": "``kda_chunked.chunked_gated_delta``",
    "``cuda.kernel_gated_delta``": "``kda_cuda.kernel_gated_delta``",
    "GLM53_KDA_PREFILL_KERNEL_METHOD": "MLX_VLM_GLM5_KDA_PREFILL_METHOD",
    "glm53_kda_prefill": "glm5_next_kda_prefill",
    "replaced helper) goes to the object it wraps: stock, or another patch such as\n"
    "compiled_kda_decode, which handles length 1 and passes prefill on.\n"
    "\n"
    "The wrapper, not the module-level name ``gated_delta_update`` that language.py\n"
    "imports, is the target: the drift guard fingerprints definitions, and an\n"
    "imported name has none.\n": "replaced helper) returns None, and the stock body runs.\n",
}

HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "Glm5NextLinearAttention.__call__",
        "import": "from . import kda_prefill",
        "code": (
            "if kda_prefill.ENABLED:\n"
            "    output = kda_prefill.prefill_call(self, x, mask, cache)\n"
            "    if output is not None:\n"
            "        return output\n"
        ),
    },
)

FAST_PATH = "mlx_vlm.models.glm5_next.kda_prefill:prefill_call"

TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_kda_prefill.py"}

PR_SECTIONS = (
    ("Why and how", ("What it replaces", "The math", "When it steps aside")),
    ("Numerics (not bit-identical: quality measured)", ("Quality",)),
    ("Measured effect", ("Speed",)),
)
