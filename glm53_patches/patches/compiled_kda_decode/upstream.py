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

# PR sections: (heading in PR.md, headings of PATCH.md it is made of).
PR_SECTIONS = (
    ("Why and how", ("What it replaces", "When it steps aside")),
    ("Why the outputs are bit-identical", ("Why it is exact",)),
    ("Measured effect", ("Measured (CPU)",)),
)
