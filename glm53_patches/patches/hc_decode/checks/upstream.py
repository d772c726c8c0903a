"""How hc_decode becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream modules are generated from ``layer.py``
and ``glm53_patches/kernels/hc_sinkhorn.py`` themselves (see
``glm53_patches/stage/source.py`` for the rules), so the plugin and the pull
request run the same code.
"""

TITLE = "glm5_next: opt-in fused hyper-connection decode layer (MLX_VLM_GLM5_HC_DECODE)"

# Off by default upstream: `MLX_VLM_GLM5_HC_DECODE=1` turns it on. The switch
# is read once, at import, into `ENABLED` of the first module below.
SWITCH = "MLX_VLM_GLM5_HC_DECODE"

# This patch's modules -> the new files they become in mlx-vlm: the compiled
# decode layer, and the one-launch Sinkhorn-collapse kernel (CUDA and Metal).
MODULES = {
    "layer": "mlx_vlm/models/glm5_next/hc_decode.py",
    "glm53_patches.kernels.hc_sinkhorn": "mlx_vlm/models/glm5_next/hc_sinkhorn.py",
}

# Top-level definitions that only the plugin needs: the wrapper it installs
# and its GLM53_HC_DECODE_KERNEL knob.
PLUGIN_ONLY = ("make_call", "WRAPPER_MARK")

# The plugin runs the kernel where `glm53-patches verify hc_decode` passed on
# the user's machine. Upstream has no verify records: the kernel gets its own
# default-off switch, and only on CUDA, the one backend it was checked on.
REPLACE = {
    "kernel_setting": '''
def kernel_setting(backend):
    """The one-launch kernel runs only with MLX_VLM_GLM5_HC_DECODE_KERNEL=1, on CUDA.

    The CUDA kernel was checked bit-identical to the stock path on one H200
    (MLX 0.32.4). The Metal kernel has not been run on a Mac yet, so Metal
    keeps the compiled path (which calls the stock fused ``_hc_kernel``);
    ``forcing_kernel(True)`` runs it, as the tests do on a GPU.
    """
    return backend == "cuda" and os.environ.get("MLX_VLM_GLM5_HC_DECODE_KERNEL", "0") == "1"
''',
}

# Plugin names inside string literals of the kernel module.
TEXT = {
    "glm53_hc_sinkhorn_collapse": "glm5_hc_sinkhorn_collapse",
    "for diagnosis by\n``glm53_patches.patches.hc_decode.checks.device_check``: ": "for diagnosing a\nmismatch on a new GPU: ",
}

# Where mlx-vlm calls the new code: these lines go first in the function's
# body (found by name in the AST, so on every release), `import` among the
# file's imports.
HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "DecoderLayer.__call__",
        "import": "from . import hc_decode",
        "code": (
            "if hc_decode.ENABLED:\n"
            "    output = hc_decode.decode_step(self, x, mask, cache, prev_topk_indices)\n"
            "    if output is not None:\n"
            "        return output\n"
        ),
    },
)

# The function whose non-None results prove that the fast path ran.
FAST_PATH = "mlx_vlm.models.glm5_next.hc_decode:decode_step"

# Upstream-style tests kept in this folder -> where they go in mlx-vlm (the
# file name keeps pytest from collecting it here, where the module it tests
# does not exist).
TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_hc_decode.py"}

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/glm5_next/hc_decode.py` and
`mlx_vlm/models/glm5_next/hc_sinkhorn.py`. With the switch on, single-token
decode of a `DecoderLayer` runs each hyper-connection's collapse (flatten,
`rms_norm`, mix matmul, Sinkhorn, weighted sum), the branch input norm and the
expand as `mx.compile`d graphs. With `MLX_VLM_GLM5_HC_DECODE_KERNEL=1` as
well, on CUDA, the Sinkhorn collapse is one kernel launch instead of about 80.
Prefill, training and other hyper-connection shapes run the current code.

Bit-identical to the current code: the compiled path on the CPU (tested) and
on CUDA, and the kernel on CUDA (one H200, MLX 0.32.4). The Metal version of
the kernel has not run; on Metal the compiled path runs, which calls the
current fused `_hc_kernel`.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): one hyper-connection, bf16 activations, batch 1, hidden 4096, "
        "hc_mult 4, 20 Sinkhorn iterations; median of 8 interleaved rounds x 60 single evaluations",
        "Measured (CUDA)",
        """
| per hyper-connection | stock | compiled (kernel off) | kernel |
|---|---|---|---|
| Sinkhorn + weighted sum (`_hc_ops` vs the kernel) | 0.824 ms | - | 0.0675 ms (12.2x) |
| whole collapse (astype, rms_norm, mix matmul, Sinkhorn, sum, branch norm) | 0.869 ms | 0.816 ms | 0.115 ms (7.5x) |
| real-width decoder layer (2-head KDA, 256-wide MLP: mostly HC) | 2.09 ms | 2.05 ms | 0.99 ms |

The layer figure's stock arm drifted between rounds (2.25 -> 1.54 ms); per
round the kernel arm is 2.0x to 2.5x faster.
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): the whole decode step of a 45-layer real-width model with 64 "
        "experts per MoE layer, random weights, the kernel on; 2 interleaved rounds of 12 steps, median "
        "[min-max of round medians]; logits, tokens and final caches bit-identical to the current code",
        "Measured (CUDA)",
        """
| ms per token | stock | hc_decode (kernel) |
|---|---|---|
| context 256 | 94.4 [91.6-96.2] | 44.0 [43.5-50.4], 2.14x |
| context 4096 | 106.1 [101.1-108.5] | 76.9 [55.7-81.1], 1.38x |
| graph primitives per step (not views) | 16,286 (11,679) | 7,106 (3,759) |
""",
    ),
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): the same 45-layer step at a 4k context with the kernel off "
        "(the compiled path), 2 interleaved rounds",
        "Measured (CUDA)",
        """
the compiled path gave 174.7 [166.1-183.7] ms against
stock's 161.6 [147.2-165.0] ms (0.93x, inside the spread), bit-identical.
""",
    ),
    (
        "CPU (2-core machine, shared, MLX 0.32.4): a tiny model (hidden 128, 8 layers), 24 interleaved rounds "
        "x 8 decode steps, the current code vs the compiled path",
        "Measured (CPU)",
        """
fp32 22.2 vs 22.5 ms/step (per-round ratio median 1.00, spread 0.57-1.97),
4-bit 24.8 vs 29.6 ms/step (ratio median 0.92, spread 0.31-3.5): no
difference resolved on this machine.
""",
    ),
    (
        "CPU graph of one decode step's logits, primitives",
        "Graph primitives",
        """
tiny model, 8 layers, CPU: stock 3,439 (2,275 not counting views) ->
compiled 3,199 (2,163).
""",
    ),
)
