"""How router_select becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. The upstream modules are generated from ``gate.py`` and
``kernel.py`` themselves (see ``glm53_patches/stage/source.py``).
"""

TITLE = "glm5_next: the MoE router's selection in one CUDA launch (MLX_VLM_GLM5_ROUTER_SELECT)"

SWITCH = "MLX_VLM_GLM5_ROUTER_SELECT"

MODULES = {
    "gate": "mlx_vlm/models/glm5_next/router_select.py",
    "kernel": "mlx_vlm/models/glm5_next/router_select_kernel.py",
}

PLUGIN_ONLY = ("make_call", "clear")

# The plugin runs the kernel where `glm53-patches verify router_select` passed
# on the user's machine; upstream has no verify records: the kernel runs on
# CUDA, where it was checked bit-identical, whenever the module is switched on.
REPLACE = {
    "kernel_wanted": '''
def kernel_wanted(backend):
    """The kernel runs on CUDA (checked bit-identical there); the Metal twin has not run on a Mac yet."""
    return backend == "cuda"
''',
}

TEXT = {
    "glm53_router_select": "glm5_next_router_select",
    "Which one stock uses on a machine is what ``verify``\n  establishes": "Which one stock uses is a property of the backend\n  (order 0 on CUDA in MLX 0.32.x)",
    "``glm53_patches/checks/metal`` type-checks the source MLX\ngenerates and runs it, emulated, against those stock texts; it has not run on\nany Mac, and runs only where ``glm53-patches verify router_select`` passed there.": "It has not run on any Mac; it is not enabled there.",
    "the kernel runs where ``glm53-patches verify router_select`` passed, or with\nGLM53_ROUTER_SELECT_KERNEL=1 (``glm53_patches/kernel_switch.py``).": "the kernel runs on CUDA, where it was checked bit-identical.",
}

HOOKS = (
    {
        "file": "mlx_vlm/models/glm5_next/language.py",
        "function": "MoEGate.__call__",
        "import": "from . import router_select",
        "code": (
            "if router_select.ENABLED:\n"
            "    selected = router_select.select(self, x)\n"
            "    if selected is not None:\n"
            "        return selected\n"
        ),
    },
)

FAST_PATH = "mlx_vlm.models.glm5_next.router_select:select"

# The kernel runs on GPUs only: on the CPU the staged hook is reached and declines.
GPU_ONLY = True

TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_glm5_next_router_select.py"}

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/models/glm5_next/router_select.py` and
`mlx_vlm/models/glm5_next/router_select_kernel.py`. With the switch on, on
CUDA, `MoEGate` runs what follows its gate matmul (sigmoid, correction bias,
top-k in the order the backend's `argpartition` returns, weight
normalisation and scaling) as one kernel launch instead of about 6. On the
CPU, and on Metal, where the kernel has not run, the current code runs.

Bit-identical to the current code on CUDA (one H200, MLX 0.32.4): indices and
weights, ties and NaN rows included, and a tiny model's greedy logits. The
order of the selected experts is a property of the backend's
`argpartition`; the kernel follows the stable sort of MLX 0.32's CUDA
backend.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CUDA (one NVIDIA H200, MLX 0.32.4): bf16, real widths; the router alone, each call evaluated, 6 "
        "interleaved rounds x 200 calls",
        "Measured",
        """
The per-call figure is the clean one: -16.5 us per router call.
""",
    ),
)
