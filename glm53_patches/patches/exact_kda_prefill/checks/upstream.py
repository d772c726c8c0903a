"""How exact_kda_prefill becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream modules are generated from ``recurrence.py``
and ``kernel.py`` themselves (see ``glm53_patches/stage/source.py``).
"""

TITLE = "gated_delta: KDA prefill's recurrence on CUDA in one launch per chunk, bit-identical to gated_delta_ops (MLX_VLM_EXACT_KDA_PREFILL)"

SWITCH = "MLX_VLM_EXACT_KDA_PREFILL"

MODULES = {
    "recurrence": "mlx_vlm/models/exact_kda_prefill.py",
    "kernel": "mlx_vlm/models/exact_kda_prefill_kernel.py",
}

PLUGIN_ONLY = ("make_call", "clear")

# The plugin runs the kernel where `glm53-patches verify exact_kda_prefill`
# passed on the user's machine; upstream has no verify records: the kernel runs
# on CUDA, where it was checked bit-identical, whenever the module is switched on.
REPLACE = {
    "looped": '''
def looped(q, k, v, g, beta, state=None, mask=None, state_steps=None):
    """``gated_delta_ops(...)``'s result through the kernel on CUDA, or None (nothing touched) where it does not run."""
    if not cuda_here() or unsupported(q, k, v, g, beta, state, mask, state_steps) is not None:
        return None
    return looped_gated_delta(q, k, v, g, beta, state, mask, state_steps)
''',
}

TEXT = {
    "glm53_exact_kda_prefill": "exact_kda_prefill",
    "On CUDA, where ``glm53-patches verify\nexact_kda_prefill`` passed (or GLM53_EXACT_KDA_PREFILL_KERNEL=1), a call the": "On CUDA, a call the",
    "(``FMA_STATE``; ``verify`` tries the other when the default fails)": "(``FMA_STATE``, as checked on CUDA)",
}

HOOKS = (
    {
        "file": "mlx_vlm/models/gated_delta.py",
        "function": "gated_delta_ops",
        "import": "from . import exact_kda_prefill",
        "code": (
            "if exact_kda_prefill.ENABLED:\n"
            "    result = exact_kda_prefill.looped(q, k, v, g, beta, state, mask, state_steps)\n"
            "    if result is not None:\n"
            "        return result\n"
        ),
    },
)

FAST_PATH = "mlx_vlm.models.exact_kda_prefill:looped"

# The kernel runs on CUDA only: on the CPU the staged hook is reached and declines.
GPU_ONLY = True

TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_exact_kda_prefill.py"}

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/exact_kda_prefill.py` and
`mlx_vlm/models/exact_kda_prefill_kernel.py`. With the switch on, on CUDA,
`gated_delta_ops` (the recurrence `gated_delta_update` runs off Metal: a
Python loop of one compiled step per token) runs as one kernel launch per call
that loops the same step, each value rounded where the compiled step rounds
it on CUDA. It covers masked and padded batches, a carried state and the
per-token history (`state_steps`). On the CPU and on Metal (which has its own
kernel) the current code runs.

Bit-identical to the current code on CUDA (one H200, MLX 0.32.4): the op at
4 x 64 and 64 x 128 heads, 2 to 2,048 tokens, with and without history; a
KDA layer over two prefill chunks and 4 decode steps, dense and 8-bit; a
tiny model's greedy logits.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): one KDA layer (hyper-connections, mixer, MoE) of a real-width "
        "model with 64 experts, a 4,096-token prefill in chunks of 2,048, bf16, 2 interleaved rounds",
        "Measured (H200, 2026-12-02, s17)",
        """
| what | stock | exact_kda_prefill | kda_prefill_kernel (numerics-changing) |
|---|---|---|---|
| one KDA layer (HC + mixer + MoE), 4,096 tokens | 5,058 tok/s [4,817-5,323] | **10,934 [10,911-10,957], 2.16x**, bit-identical | 10,940 [10,935-10,944], 2.16x |
""",
    ),
)
