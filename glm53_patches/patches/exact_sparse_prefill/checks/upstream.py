"""How exact_sparse_prefill becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream modules are generated from ``attention.py``
and ``kernel.py`` themselves (see ``glm53_patches/stage/source.py``).
"""

TITLE = "glm5_next: sparse prefill attention on CUDA without the per-head key gathers, bit-identical (MLX_VLM_GLM5_EXACT_SPARSE_PREFILL)"

SWITCH = "MLX_VLM_GLM5_EXACT_SPARSE_PREFILL"

MODULES = {
    "attention": "mlx_vlm/models/glm5_next/exact_sparse_prefill.py",
    "kernel": "mlx_vlm/models/glm5_next/exact_sparse_prefill_kernel.py",
}

PLUGIN_ONLY = ("make_sparse_prefill", "clear")

# The plugin runs the kernels where `glm53-patches verify exact_sparse_prefill`
# passed on the user's machine; upstream has no verify records: they run on
# CUDA, where they were checked bit-identical, whenever the module is switched on.
REPLACE = {
    "prefill_attention": '''
def prefill_attention(q, k, v, indices, scale, chunk_size=16):
    """The kernels' result on CUDA, or None (nothing built) where the current code must run."""
    if gpu_backend() != "cuda" or unsupported(q, k, v, indices, chunk_size) is not None:
        return None
    return attention(q, k, v, indices, scale, chunk_size)
''',
}

TEXT = {
    "glm53_exact_sparse": "glm5_next_exact_sparse",
    "(not CUDA, not verified here, other shapes or\ndtypes) stock's function runs, counted by reason.": "(not CUDA, other shapes or dtypes) the\ncurrent code runs.",
    "tried by ``verify``": "checked on CUDA",
}

HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "_sparse_prefill_attention",
        "import": "from . import exact_sparse_prefill",
        "code": (
            "if exact_sparse_prefill.ENABLED:\n"
            "    output = exact_sparse_prefill.prefill_attention(q, k, v, indices, scale, chunk_size)\n"
            "    if output is not None:\n"
            "        return output\n"
        ),
    },
)

FAST_PATH = "mlx_vlm.models.glm5_next.exact_sparse_prefill:prefill_attention"

# The kernels run on CUDA only: on the CPU the staged hook is reached and declines.
GPU_ONLY = True

TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_exact_sparse_prefill.py"}

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/glm5_next/exact_sparse_prefill.py` and
`mlx_vlm/models/glm5_next/exact_sparse_prefill_kernel.py`. With the switch on,
on CUDA, `_sparse_prefill_attention` no longer gathers each query's selected
keys for every head (1 GB per 16-query chunk at GLM-5.3-Flash's sizes): one
kernel launch scores them where they lie, in the accumulation order of MLX's
CUDA gemv, which is what the SDPA fallback runs for one query per row. The
softmax, a plain copy of the selected value rows and the value matmul stay
the current ops on the current 16-query chunks, so cuBLAS sees the same
shapes. On the CPU and on Metal the current code runs.

Bit-identical to the current code on CUDA (one H200, MLX 0.32.4): float32,
bf16 and float16, batch 1 and 2, strided cache views, padded rows, 64 heads x
256 over 4,096 keys, and a tiny model's greedy logits.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): one 2,048-query call over 4,096 keys, 64 heads x 256, bf16; "
        "medians of 3 interleaved rounds after a warm-up",
        "Speed (H200, one 2,048-query call, 4,096 keys, 64 x 256, bf16)",
        """
| K/V | stock | patched | ratio |
|---|---|---|---|
| contiguous | 1,055 ms | 162 ms | **6.5x** |
| strided (projected cache view) | 1,073 ms | 163 ms | **6.6x** |
""",
    ),
)
