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

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/glm5_next/latent_prefill.py`. With the switch on,
prefill of the DSA layers off Metal attends each query over its selected
latent rows with the absorbed query, as decode already does (the heads share
the gathered rows), instead of projecting per-head keys and values and
gathering them per head, 16 queries at a time. While the cache holds at
most 16 keys per selected slot, each block of queries attends over every
latent row with the selection as a boolean mask (two batched matmuls, no
per-query gather); beyond that, over its gathered rows.

The same attention, rounded differently, so not bit-identical: on the CPU a
tiny model's teacher-forced logits differ from the current code's by a KL of
about 3e-13 (fp32 and 4-bit). On CUDA (one H200) a DSA layer's prefill runs
3.6x faster with a quarter of the peak memory; no real-weight quality figure
exists there.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CPU (MLX 0.32.4): a tiny glm5_next, 2 x 300 teacher-forced tokens, the indexer selecting 64 of up to "
        "300 keys; this change against the current code",
        "Numerics and the gate",
        """
| model | KL(stock \\|\\| patch) mean | max | top-1 agreement |
|---|---|---|---|
| fp32 | 3.2e-13 | 1.5e-12 | 600/600 |
| 4-bit | 3.2e-13 | 1.2e-12 | 599/600 (the one differing position is a near-tie in stock) |
""",
    ),
    (
        "CPU (2 cores, a tiny fp32 model)",
        "Measured",
        """
DSA layer prefill 1.07x at
64 tokens, 1.10x at 200 (noise-level; the CPU is not the target).
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): one DSA decoder layer with a full indexer (both "
        "hyper-connections, indexer, attention, MoE) of a 5-layer real-width model with 64 experts, one timed "
        "run of each after a check run",
        "Measured",
        """
prefills 4,096 tokens in 689 ms instead of 2,445 (3.55x) and 16,384 in 2,770
instead of 9,991 (3.61x); peak memory 48.1 -> 12.2 GB. The largest
difference in the layer's bf16 output streams was 2.73 (random weights); no
real-weight quality figure on CUDA exists.
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): the same layer at 32,768 tokens, a later run",
        "Measured",
        """
the DSA layer at
32,768 tokens, 20.1 s -> 5.6 s (1,630 -> 5,899 tok/s, 3.62x; peak memory 49.7
-> 13.2 GB; max abs diff of the output 2.84)
""",
    ),
)
