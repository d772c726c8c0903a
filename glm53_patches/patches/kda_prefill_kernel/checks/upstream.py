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
    return chunk if chunk in (16, 32, 64, 128) else DEFAULT_CHUNK
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

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/glm5_next/kda_prefill.py`,
`mlx_vlm/models/glm5_next/kda_chunked.py` and
`mlx_vlm/models/glm5_next/kda_cuda.py`. With the switch on, prefill (more
than one token) of `Glm5NextLinearAttention` off Metal runs the gated delta
rule in one kernel launch on CUDA, and on the CPU in chunks of 16 tokens
(`MLX_VLM_GLM5_KDA_PREFILL_CHUNK`: 16, 32, 64 or 128) with matmuls (a WY/UT
transform), instead of the per-token loop; `MLX_VLM_GLM5_KDA_PREFILL_METHOD`
picks one. On Metal, which has a fused kernel already, and for inputs the
kernel does not cover, the current code runs.

Not bit-identical: float32 like the current code, in another order. On the
CPU the chunked form's state error against a float64 reference stays near the
current code's, and a tiny model's teacher-forced logits agree with it to a
KL of about 1e-12; on CUDA (one H200) the kernel's state error equals the
current loop's.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CPU (MLX 0.32.4): the recurrence against a float64 per-token reference, B=2, T=300, 4 heads x 64, "
        "row 1 left-padded by 37, random initial state, 3 seeds; max abs error",
        "Quality",
        """
| inputs | stock state | patch state (C=16..64) | stock y | patch y (C=16 / 64) |
| --- | --- | --- | --- | --- |
| fp32 | 6.2e-7 - 1.06e-6 | 0.44x - 1.18x stock | 6.4e-8 - 8.5e-8 | 0.75x-1.05x / 1.13x-2.11x |
| bf16 | 7.9e-7 - 1.12e-6 | 0.37x - 0.66x stock | 4.8e-4 (bf16 output rounding) | 1.00x / 1.00x |
""",
    ),
    (
        "CPU (MLX 0.32.4): a tiny random-weight glm5_next (fp32, 5 KDA layers), this change against the "
        "current code",
        "Quality",
        """
2 x 320 random tokens, teacher-forced logits of every position, patched vs
stock: KL(stock || patch) mean 1.2e-12, max 6e-12 nats; max |dlogit|
1.1e-5 (logits up to ~4.9); top-1 agreement 640/640 (the smallest stock
top-1 margin was 8.6e-4).
""",
    ),
    (
        "CPU (2-core AMD EPYC VM with AVX-512, shared; the MLX 0.32.4 CPU wheel, which links reference BLAS): "
        "the recurrence alone, batch 1, 64 heads x 128, bf16 inputs, fresh state, 3 interleaved rounds; "
        "ratio: median of the per-round ratios (min-max)",
        "Speed",
        """
| T | stock (median s) | C=16 | C=32 | C=64 |
| --- | --- | --- | --- | --- |
| 512 | 2.21 | 1.49 s, 1.55x (1.31-1.59) | 1.63 s, 1.41x (1.03-1.46) | 2.09 s, 1.06x (0.82-1.19) |
| 2048 | 18.8 | 5.02 s, 3.17x (2.72-4.61) | 5.38 s, 3.50x (2.05-3.86) | 7.54 s, 2.50x (1.64-2.96) |
| 4096 | 25.3 | 6.96 s, 3.83x (2.83-4.38) | 6.81 s, 3.91x (2.04-3.91) | 8.66 s, 3.07x (1.74-3.08) |
""",
    ),
    (
        "CPU (same machine): the whole mixer, 64 heads x 128, hidden 256, fp32, unquantized projections, "
        "chunk 16, 3 interleaved rounds",
        "Speed",
        """
| T | stock (median s) | patch | stock/patch (min-max) | rel dev |
| --- | --- | --- | --- | --- |
| 512 | 6.13 | 5.20 | 1.12x (1.06-1.50) | 1.3e-6 |
| 2048 | 25.3 | 22.6 | 1.11x (1.10-1.15) | 1.5e-6 |
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): the recurrence at 64 heads x 128, bf16 q/k/v, float32 state, "
        "3 interleaved rounds; state error against a float64 reference",
        "The CUDA kernel",
        """
| case | stock loop | chunked C=16 | chunked C=64 | kernel | state error vs float64: stock / chunked / kernel |
|---|---|---|---|---|---|
| T=2048 | 160.0 ms | 16.4 ms | 27.8 ms | 3.96 ms | 3.5e-6 / 8.6e-4 / 3.5e-6 |
| 1024 tokens from a random state | 122.1 ms | 12.9 ms | 21.7 ms | 2.24 ms | 3.6e-6 / 8.1e-4 / 3.6e-6 |
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): one KDA decoder layer's prefill of a 5-layer real-width model with "
        "64 experts, the current code -> this change",
        "The CUDA kernel",
        """
6,611 -> 11,036 tok/s at 4,096 tokens, 6,579 -> 10,983 at
16,384, 6,605 -> 11,027 at 32,768 (1.67x each; peak memory 13.5 -> 6.7 GB at
4k, 14.6 -> 8.3 GB at 32k)
""",
    ),
)
