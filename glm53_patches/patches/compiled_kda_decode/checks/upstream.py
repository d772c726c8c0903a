"""How compiled_kda_decode becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream module is generated from ``step.py``
itself (see ``glm53_patches/stage/source.py`` for the rules), so the plugin
and the pull request run the same code.
"""

TITLE = "glm5_next: opt-in compiled KDA decode step (MLX_VLM_GLM5_COMPILED_KDA_DECODE)"

# Off by default upstream: `MLX_VLM_GLM5_COMPILED_KDA_DECODE=1` turns it on.
# The switch is read once, at import, into `ENABLED` of the first module below.
SWITCH = "MLX_VLM_GLM5_COMPILED_KDA_DECODE"

# This patch's modules -> the new files they become in mlx-vlm.
MODULES = {"step": "mlx_vlm/models/glm5_next/compiled_kda_decode.py"}

# Top-level definitions that only the plugin needs (the wrapper it installs).
PLUGIN_ONLY = ("make_call",)

# Where mlx-vlm calls the new code: these lines go first in the function's
# body (found by name in the AST, so on every release), `import` among the
# file's imports.
HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "Glm5NextLinearAttention.__call__",
        "import": "from . import compiled_kda_decode",
        "code": (
            "if compiled_kda_decode.ENABLED:\n"
            "    output = compiled_kda_decode.decode_step(self, x, mask, cache)\n"
            "    if output is not None:\n"
            "        return output\n"
        ),
    },
)

# The function whose non-None results prove that the fast path ran.
FAST_PATH = "mlx_vlm.models.glm5_next.compiled_kda_decode:decode_step"

# Upstream-style tests kept in this folder -> where they go in mlx-vlm. The
# file name does not match pytest's test_*.py / *_test.py: it runs only in a
# staged tree, where the module it tests exists.
TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_compiled_kda_decode.py"}

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/glm5_next/compiled_kda_decode.py`. With the switch on,
single-token decode of `Glm5NextLinearAttention` runs the whole mixer (qkv
projection, short convolution, q/k norms, safe gate, delta-rule step, gated
output norm, output projection) as one `mx.compile`d function of the layer's
weights, conv window and recurrent state, then stores the new window and
state in the `ArraysCache` as the current code does. Speculative verify blocks
(a speculating cache, 1 to 8 tokens) run the same function with the current
`state_steps`, and hand the conv input and intermediate states to the cache's
own `update_window` / `update_recurrent`, which record them for rollback.
Prefill, training, ragged caches and unexpected shapes or dtypes run the
current code.

The compiled function issues the same operations in the same order and
dtypes, so the outputs are bit-identical to the current code: checked on the
CPU and on CUDA (one H200, MLX 0.32.4; there the 4-bit left-padded batch cases
were inconclusive, because the current code itself was not repeatable from
run to run). Not yet run on Metal.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CPU (2-core x86-64 VM shared with other jobs, MLX 0.32.4, mlx-vlm 0.7.10): one Glm5NextLinearAttention "
        "with hidden 1024, 8 heads x 128, conv kernel 4; each sample the median of 40 decode steps, 8 rounds "
        "interleaved A B B A; median [min, max] of the samples",
        "Measured (CPU)",
        """
| case | stock µs/step | patched µs/step | speedup |
| --- | --- | --- | --- |
| fp32, B=1 | 2995 [2855, 3807] | 2898 [2809, 3554] | 1.03× |
| fp32 4-bit, B=1 | 3835 [3766, 3972] | 3788 [3730, 3990] | 1.01× |
| bf16, B=1 (3 runs) | 3783 / 4146 / 4178 | 4125 / 4026 / 4059 | 0.92× / 1.03× / 1.03× |
| fp32, B=3 | 9064 [8600, 17227] | 8861 [8351, 17287] | 1.02× |
| fp32, B=1, hidden 256, 4 × 64 | 345 [340, 567] | 283 [278, 423] | 1.22× |
""",
    ),
    (
        "CPU graph of one mixer call (output, new window and new state), primitives; non-view excludes "
        "reshape, flatten, unflatten, expand, squeeze, transpose, slice and split",
        "Measured (CPU)",
        """
| | stock | patched |
| --- | --- | --- |
| fp32 dense | 91 (40 non-view, 6 fused) | 64 (26 non-view, 9 fused) |
| bf16 dense | 99 (48 non-view) | 69 (31 non-view) |
| fp32 4-bit | 76 | 50 |
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): bf16, real widths, 45 layers with 64 experts per MoE layer, random "
        "weights; median [min-max of round medians] of interleaved rounds, each patched run first checked "
        "bit-identical to the current code",
        "Measured (H200",
        """
| what | stock | patched | ratio (per round) |
|---|---|---|---|
| KDA attention branch (3 rounds x 24 steps) | 0.654 [0.578-0.683] ms | 0.591 [0.534-0.623] ms | 1.11x (1.10, 1.16, 1.08) |
| KDA layer, HC + attention + MoE (same run) | 2.026 [2.013-2.133] ms | 2.197 [2.032-2.476] ms | 0.92x: not resolved |
| 45-layer decode step at 4k context (2 rounds x 16 steps, another start) | 161.6 [147.2-165.0] ms | 165.9 [165.0-171.6] ms | 0.97x: not resolved |
| graph primitives per 45-layer step | 16,286 | 16,184 | -102 |
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4), a later run of the same model: the whole 45-layer decode step",
        "Measured (H200",
        """
the whole 45-layer step, 2
interleaved rounds, 1.11x at context 256 (97.0 -> 87.1 ms, rounds 1.13 and
1.10) and 1.14x at 4096 (110.7 -> 96.9, rounds 1.07 and 1.09), bit-identical
""",
    ),
)
