"""How outside_probe would become an mlx-vlm pull request (read by `glm53-patches stage`)."""

TITLE = "glm5_next: the dense MLP written out (a test change)"

SWITCH = "MLX_VLM_GLM5_OUTSIDE_PROBE"

MODULES = {"mlp": "mlx_vlm/models/glm5_next/outside_probe.py"}

PLUGIN_ONLY = ("make_call",)

HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "Glm5NextMLP.__call__",
        "import": "from . import outside_probe",
        "code": (
            "if outside_probe.ENABLED:\n"
            "    out = outside_probe.dense_mlp(self, x)\n"
            "    if out is not None:\n"
            "        return out\n"
        ),
    },
)

FAST_PATH = "mlx_vlm.models.glm5_next.outside_probe:dense_mlp"

TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_outside_probe.py"}

SUMMARY = """
Adds `mlx_vlm/models/glm5_next/outside_probe.py`: with the switch on, the dense
MLP runs the same calls written out in `dense_mlp`, so the outputs are
bit-identical.
"""

MEASURED = ()
