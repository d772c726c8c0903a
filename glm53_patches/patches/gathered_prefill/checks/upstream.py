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

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/glm5_next/gathered_prefill.py`. With the switch on,
`_sparse_prefill_attention` off Metal sizes its query chunks from the shapes
(at most 2^31 elements per gathered K or V, a smaller budget on the CPU)
instead of 16 queries, flattens K/V once per call instead of once per chunk
(one copy for the strided views of the projected cache), and orders the
chunks' gathers so that memory stays bounded.

The same fused attention runs over the same values, so on the CPU the outputs
are bit-identical to the current code (fp32 and bf16, tested). On CUDA it
measured slower and, at 16,384 tokens, not bit-identical, so there it runs
the current code unless `MLX_VLM_GLM5_GATHERED_PREFILL_MIN_CONTEXT` is set;
on Metal it always runs the current code.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CPU (2-core x86-64 VM shared with other jobs, MLX 0.32.4): one sparse prefill attention call at real "
        "sizes, bf16, batch 1, 63 queries, 2,063 slots, K/V as the strided views the projected cache returns, "
        "the CPU's default chunk budget; median seconds per call of interleaved rounds, peak memory above the "
        "inputs; bit-identical outputs in every run",
        "Measured (CPU)",
        """
| heads | N (keys) / capacity | Q | stock s | patched s | ratio per round | median | peak GB stock / patched |
|---|---|---|---|---|---|---|---|
| 64 | 16484 / 16640 | 63 | 12.19 | 8.92 | 1.28, 1.49, 1.20 | 1.28 | 11.28 / 6.39 |
| 64 | 32668 / 32768 | 63 | 12.46 | 8.98 | 1.43, 1.38, 1.38 | 1.38 | 13.93 / 7.45 |
| 16 | 4196 / 4352 | 63 | 3.93 | 3.81 | 0.91, 1.04, 1.13 | 1.04 | 2.32 / 2.21 |
| 16 | 16484 / 16640 | 63 | 4.00 | 3.27 | 1.25, 1.27, 1.19, 1.20, 1.21, 1.15 | 1.21 | 2.96 / 2.41 |
| 16 | 32668 / 32768 | 63 | 6.42 | 3.31 | 4.39, 1.61, 1.42, 1.44, 1.82, 2.73 | 1.72 | 3.75 / 2.68 |
""",
    ),
    (
        "CPU (same machine and call): contiguous K/V, 64 heads, the CPU's default chunk budget (chunks of 13 "
        "queries), 4 interleaved rounds",
        "Measured (CPU)",
        """
| N (keys) | Q | stock s | patched s | ratio per round | median | peak GB stock / patched |
|---|---|---|---|---|---|---|
| 4096 | 63 | 11.42 | 11.63 | 0.78, 0.99, 1.01, 1.69 | 1.00 | 8.59 / 5.31 |
| 8192 | 63 | 17.14 | 11.22 | 1.71, 1.82, 1.34, 1.22 | 1.53 | 8.58 / 5.31 |
| 8192 (rerun) | 63 | 7.73 | 7.60 | 1.44, 1.04, 0.99, 0.98 | 1.02 | 8.59 / 5.31 |
| 4096 (rerun) | 63 | 11.30 | 11.37 | 0.98, 1.19, 1.03, 0.95 | 1.01 | 8.59 / 5.31 |

**Speed on the CPU with contiguous K/V: no resolved difference.**
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): one DSA decoder layer's prefill of a 5-layer real-width model with "
        "64 experts, one timed run after a check run; this change against the current code",
        "On CUDA",
        """
2,948 ms vs stock's 2,515 at
4,096 tokens (0.85x), 11,920 vs 9,931 at 16,384 (0.83x), peak memory 52.4 vs
48.1 GB; and at 16,384 tokens the layer's output was **not** bit-identical to
stock's (max abs diff 0.031; the caches were).
""",
    ),
)
