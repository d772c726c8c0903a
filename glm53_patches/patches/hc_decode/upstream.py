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
    "for diagnosis by\n``glm53_patches.patches.hc_decode.device_check``: ": "for diagnosing a\nmismatch on a new GPU: ",
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

# PR sections: (heading in PR.md, headings of PATCH.md it is made of).
PR_SECTIONS = (
    ("Why and how", ("What it replaces", "When it steps aside")),
    ("Why the outputs are bit-identical", ("Why it is exact",)),
    ("Verified so far", ("Verified",)),
    ("Measured effect", ("Measured (CUDA)", "Measured (CPU)", "Graph primitives per decode step")),
)
