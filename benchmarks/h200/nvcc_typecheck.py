"""Type-check CUDA kernel text with nvcc, on a machine without a GPU, the way MLX 0.32 wraps it.

``mx.fast.cuda_kernel`` compiles (with NVRTC) its default header, the kernel's
header, then ``__global__ void NAME(inputs, [x_shape,] outputs)`` whose body
declares the template arguments and holds the source. This builds the same
text for block_qmv (every width, 2/4/7 positions, 1 and 2 rows per warp),
routed_experts (both expert shapes, an input per route or per 8, its launch,
load-ahead and dequantization variants), kda_verify_kernel (its recurrence and its mixer kernel: both head
shapes, 1, 4 and 8 tokens, with and without history, fma and mask variants) and, as a control, exact_qmv's
verified kernel,
with a small stand-in for MLX's default header (``Shape``), and compiles it
for sm_90 with nvcc against the cutlass headers of MLX's CUDA wheel.
``--ptxas`` prints registers and spills. s35: 89 kernels, rc 0; s45, with the mixer kernel: 185, rc 0.
The mixer kernel's header includes MLX's device functors (``binary_ops.cuh``,
``unary_ops.cuh``), which the wheel does not ship: ``--mlx-source`` names a
folder holding ``mlx/backend/cuda/device`` from MLX's sources (s45: v0.32.1's,
``git archive v0.32.1 mlx/backend/cuda/device | tar -x -C /tmp/mlxsrc``).

    pip download --no-deps mlx-cuda-13==0.32.4 -d /tmp/w && unzip -q /tmp/w/*.whl -d /tmp/w/x
    python benchmarks/h200/nvcc_typecheck.py --include /tmp/w/x/mlx/include --mlx-source /tmp/mlxsrc [--ptxas]

It shows the text compiles; only a GPU's ``verify`` shows what it computes.
"""

import argparse
import itertools
import pathlib
import subprocess
import sys
import tempfile

from glm53_patches.patches.block_qmv import kernel as block
from glm53_patches.patches.exact_qmv import kernel as single
from glm53_patches.patches.kda_verify_kernel import kernel as recurrence
from glm53_patches.patches.routed_experts import kernel as experts

STAND_IN = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cooperative_groups.h>
struct Shape { int32_t v[8]; __device__ int32_t operator[](int i) const { return v[i]; } };
"""
CUDA_TYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}
_HEADERS = set()  # headers already in the file
RECURRENCE_TYPES = {"g": "float", "state": "float", "mask": "bool", "state_out": "float", "states": "float"}
MIXER_TYPES = {**RECURRENCE_TYPES, "A_log": "float", "dt_bias": "float", "consts": "float"}


def unit(index, spec, template, types=None):
    """One kernel as MLX builds it, its header's namespace made unique so that many fit one file: a pointer
    per input (``w`` and ``idx`` uint32, the rest of type T, bf16 where T is not a template argument; or
    as ``types`` names them) and the ``<input>_shape`` arguments its source names."""
    source, header = spec["cuda"]
    t = dict(template).get("T", CUDA_TYPES["bf16"])
    types = types or {}
    name = f"{spec['name']}_{index}"
    params = []
    for arg in spec["inputs"]:
        params.append(f"const {types.get(arg, 'uint32_t' if arg in ('w', 'idx') else t)}* {arg}")
        if f"{arg}_shape" in source:
            params.append(f"const __grid_constant__ Shape {arg}_shape")
    params += [f"{types.get(out, t)}* {out}" for out in spec["outputs"]]
    shared = header and "glm53_qmv" not in header  # a header without a namespace to rename: once per file
    text = "" if shared and any(header in seen for seen in _HEADERS) else (header or "")
    _HEADERS.add(header)
    text += "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
    text += f"__global__ void {name}({', '.join(params)}) {{\n"
    text += "".join(f"  using {k} = {v};\n" if k == "T" else f"  constexpr int {k} = {v};\n" for k, v in template)
    text += source + "\n}\n}\n"
    return text.replace("glm53_qmv", f"glm53_qmv_{index}")


def units():
    out = []
    for (heads, dim), tokens, steps, fma, has_mask in itertools.product(  # first: its header holds the recurrence's
            ((64, 128), (4, 64)), (1, 4, 8), (0, 3), ((1, 1), (1, 0)), (0, 1)):
        out.append((recurrence.MIXER_KERNEL, [("H", heads), ("D", dim), ("TOKENS", tokens), ("STEPS", min(steps, tokens)),
                                              ("KC", 4), ("FMA_NORM", fma[0]), ("FMA_STATE", fma[1]),
                                              ("HAS_MASK", has_mask)], MIXER_TYPES))
    for t, bits, positions, rpw in itertools.product(CUDA_TYPES.values(), (2, 3, 4, 5, 6, 8), (2, 4, 7), (1, 2)):
        out.append((block.BLOCK_QMV, [("T", t), ("BITS", bits), ("GROUP", 64), ("K", 4096), ("POSITIONS", positions),
                                      ("WARPS", block.WARPS), ("RPW", rpw)]))
    out.append((single.QMV, [("T", CUDA_TYPES["bf16"]), ("BITS", 6), ("GROUP", 64), ("K", 4096), ("AHEAD", 1),
                             ("WARPS", 4), ("RPW", 2)]))  # the control: passed CUDA verify (s28)
    for (n, k), per_row, (warps, ahead) in itertools.product(
            ((2048, 4096), (4096, 2048)), (8, 1), ((experts.WARPS, experts.AHEAD), (2, 2), (8, 3), (4, 3))):
        out.append((experts.EXPERT_MMA, [("K", k), ("N", n), ("PER_ROW", per_row), ("WARPS", warps),
                                         ("AHEAD", ahead)]))
    for (heads, dim), tokens, steps, fma_state, has_mask in itertools.product(
            ((64, 128), (4, 64)), (1, 4, 8), (0, 3), (0, 1), (0, 1)):
        out.append((recurrence.KERNEL, [("H", heads), ("D", dim), ("TOKENS", tokens), ("STEPS", min(steps, tokens)),
                                        ("FMA_STATE", fma_state), ("HAS_MASK", has_mask)], RECURRENCE_TYPES))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--include", required=True, help="the include folder of MLX's CUDA wheel (cutlass)")
    parser.add_argument("--ptxas", action="store_true", help="print registers and spills per kernel")
    parser.add_argument("--mlx-source", help="a folder with MLX's mlx/backend/cuda/device headers (the mixer kernel's)")
    args = parser.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / "kernels.cu").write_text(STAND_IN + "\n".join(unit(i, *u) for i, u in enumerate(units())))
    command = ["nvcc", "-std=c++17", "-arch=sm_90", "-c", "-o", str(folder / "kernels.o"), f"-I{args.include}",
               "--expt-relaxed-constexpr", str(folder / "kernels.cu")] + (["-Xptxas", "-v"] if args.ptxas else [])
    command += [f"-I{args.mlx_source}"] if args.mlx_source else []
    result = subprocess.run(command, capture_output=True, text=True)
    for line in result.stderr.splitlines():
        if result.returncode or "registers" in line or "spill" in line or "Compiling entry" in line:
            print(line)
    print(f"nvcc rc={result.returncode} for {len(units())} kernels")
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
