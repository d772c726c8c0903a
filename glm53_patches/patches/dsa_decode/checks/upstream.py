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

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/glm5_next/dsa_decode.py` and
`mlx_vlm/models/glm5_next/dsa_select_kernel.py`. With the switch on,
single-token decode of the DSA layers changes in two places. The indexer keeps
the current projections, cache updates, pool scores and `argpartition`, then
turns the selected pools into key positions with integer arithmetic in one
compiled graph, instead of context-sized tables, a cumulative sum and gathers.
The attention gathers the selected latent rows as whole rows instead of an
element-wise `take_along_axis`. On CUDA the selection after the pool scores is
one kernel launch (up to 8,192 pools, 131k keys); elsewhere, and beyond that,
the compiled path runs.

Every float value comes from the same calls on the same arrays and the rest
is integer arithmetic, so the outputs are bit-identical to the current code:
checked on the CPU and, with the kernel, on CUDA (one H200, MLX 0.32.4). The
Metal version of the kernel has not run; on Metal the compiled path runs.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CPU (2-core AMD EPYC, MLX 0.32.4): bf16, real dimensions (indexer 32 heads x 128, pools of 16, top "
        "2,048; attention 64 heads, latent 512, 2,063 selected keys); ms per call, median [min-max of round "
        "medians] of 6 rounds x 12 steps, the two versions alternated per round",
        "Measured",
        """
| piece | context | stock | dsa_decode | stock/patched |
|---|---|---|---|---|
| indexer | 4,096 | 6.82 [6.74-7.17] | 6.72 [6.59-6.83] | 1.01x |
| indexer | 16,384 | 8.25 [8.07-8.54] | 7.98 [7.81-8.31] | 1.03x |
| indexer | 32,768 | 9.65 [9.48-9.99] | 9.32 [9.16-9.35] | 1.04x |
| attend | 4,096 | 97.7 [97.3-98.4] | 94.6 [93.8-95.2] | 1.03x |
| attend | 16,384 | 97.7 [97.2-99.0] | 94.3 [94.1-95.3] | 1.04x |
| attend | 32,768 | 98.2 [97.4-98.8] | 96.0 [94.5-96.5] | 1.02x |

A second run with the machine busier gave the indexer 0.96x / 0.84x /
1.05x with round spreads of 20-35%: on the CPU the indexer's gain is not
resolved, the attention's 2-4% is (its rounds do not overlap in either run).
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): the indexer alone at real dimensions, alone on the GPU, 6 rounds x "
        "20 calls, ms per call; the kernel checked bit-identical to the current code at 2,040 to 131,072 keys",
        "The selection kernel",
        """
| keys | stock | compiled path | selection kernel | primitives stock / compiled / kernel (not views) |
|---|---|---|---|---|
| 4,096 | 0.974 [0.756-1.125] | 0.946 | **0.473 (2.06x)** | 98 / 84 / 37 |
| 16,384 | 1.131 [1.088-1.177] | 0.966 | **0.467 (2.42x)** | 98 / 84 / 37 |
| 32,768 | 1.184 [1.131-1.261] | 1.045 | **0.664 (1.78x)** | 98 / 84 / 37 |
| 65,536 | 1.235 [1.202-1.303] | 1.088 | **0.638 (1.94x)** | 98 / 84 / 37 |
| 131,072 | 1.349 [1.285-1.440] | 1.156 | **0.905 (1.49x)** | 98 / 84 / 37 |
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): one DSA decoder layer of a 5-layer real-width model with 64 "
        "experts, the kernel on, 3 rounds x 16 steps, ms per decode step, the current code -> this change",
        "The selection kernel",
        """
3.775 -> 3.505 ms at 4k, 3.497 -> 2.977 at 16k, 3.451 -> 3.011 at
32k (1.08-1.17x); its attention branch 1.874 -> 1.480 ms at 4k.
""",
    ),
)
