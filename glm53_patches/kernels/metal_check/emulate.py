"""Differential emulation: a Metal twin and the stock Metal kernels it must match, run on the same inputs.

Both are compiled as C++ with g++ through the same shim (``msl.h``, emulation
mode: each threadgroup's threads are host threads; ``simd_sum`` and
``simd_shuffle`` exchange real values between them; ``metal::exp`` is not
``metal::precise::exp``), and their outputs compared bit for bit. The twin is
the source MLX generates for it (``source.generated``). The stock kernels are
MLX 0.32.4's own text, read at run time from the headers the installed mlx
wheel ships (``mlx/include/mlx/backend/metal/kernels``), launched with the
parameters MLX's dispatch gives them (cited per program).

What this cannot show: the Metal compiler's fma contraction (g++ here does
not contract: -ffp-contract=off), the hardware's own simd_sum order (both
sides use the same one here), bfloat arithmetic other than "in float, rounded
to nearest even", and pipeline thread limits.
"""

import pathlib
import re
import subprocess
import tempfile

import numpy as np

import mlx.core as mx

from . import typecheck

HEADERS = pathlib.Path(mx.__file__).parent / "include" / "mlx" / "backend" / "metal" / "kernels"


def excerpt(path, start):
    """From ``path`` (under the installed MLX kernels), the declaration that begins at the line ``start``, verbatim.

    It runs to the brace that closes the first one opened after ``start``
    (and a ``;`` right after it); a ``template <...>`` line just above is kept.
    """
    text = (HEADERS / path).read_text()
    at = text.index(start)
    above = text.rfind("\n", 0, at - 1)
    line_above = text[above + 1:at]
    if line_above.startswith("template"):
        at = above + 1
    else:  # a multi-line template header
        head = text.rfind("template <", 0, at)
        if head != -1 and text[head:at].count(";") == 0 and text[head:at].count("{") == 0:
            at = head
    depth, i = 0, text.index("{", text.index(start))
    while True:
        depth += text[i] == "{"
        depth -= text[i] == "}"
        if depth == 0:
            break
        i += 1
    end = i + 1 + (text[i + 1:i + 2] == ";")
    return f"// MLX 0.32.4, mlx/backend/metal/kernels/{path} (installed headers), verbatim\n" + text[at:end] + "\n"


def macro(path, name):
    """The ``#define name`` of ``path`` with its continuation lines, verbatim."""
    lines = (HEADERS / path).read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"#define {name}"))
    end = start
    while lines[end].endswith("\\"):
        end += 1
    return "\n".join(lines[start:end + 1]) + "\n"


_INSTANCE = re.compile(r"^template \[\[host_name\(\"[^\"]*\"\)\]\] \[\[kernel\]\] decltype\(([^)]*)\)", re.M)
_PARAM = re.compile(r"^\s+(.*?)\s(\w+) \[\[(\w+)(?:\((\d+)\))?\]\][,)]", re.M)


def launch(source, buffers):
    """The C++ call of a kernel MLX generated: ``name<template>(buffers..., attributes...)``.

    ``buffers``: {parameter name: C++ expression}; thread attributes come
    from the emulation's per-thread ``__msl``.
    """
    instance = _INSTANCE.search(source).group(1)
    signature = source[source.index("[[kernel]] void "):source.index(") {\n")+3]
    args = []
    for _, name, attribute, _ in _PARAM.findall(signature):
        args.append(buffers[name] if attribute == "buffer" else f"__msl.{attribute}")
    return f"{instance}({', '.join(args)})"


PRELUDE = r"""
template <class T> struct mlx_atomic;  // named by Sum's atomic members, which no kernel here calls
template <class... A> void mlx_atomic_fetch_add_explicit(A...);
template <class X> std::vector<X> load(const char* path, size_t n) {
  std::vector<X> a(n);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(a.data(), sizeof(X), n, f) != n) { std::fprintf(stderr, "read %s\n", path); std::exit(2); }
  std::fclose(f);
  return a;
}
template <class X> void save(const char* path, const std::vector<X>& a) {
  FILE* f = std::fopen(path, "wb");
  std::fwrite(a.data(), sizeof(X), a.size(), f);
  std::fclose(f);
}
"""


def build_and_run(folder, program, files, timeout=600):
    """Compile ``program`` (MSL through the shim, emulation mode) with g++ and run it with ``files`` as arguments."""
    text = typecheck.expand(program, typecheck=False)
    cpp, binary = folder / "emulation.cpp", folder / "emulation"
    cpp.write_text(text)
    subprocess.run(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-w", "-o", str(binary), str(cpp)],
                   check=True)
    subprocess.run([str(binary), *map(str, files)], check=True, timeout=timeout)


def _host_type(dtype):
    return {mx.float32: "float", mx.bfloat16: "bfloat", mx.float16: "half", mx.int32: "int", mx.bool_: "bool"}[dtype]


def to_file(array, path):
    array = mx.contiguous(array)
    if array.dtype in (mx.bfloat16, mx.float16):
        np.array(array.view(mx.uint16)).tofile(path)
    elif array.dtype == mx.bool_:
        np.array(array).astype(np.uint8).tofile(path)
    else:
        np.array(array).tofile(path)


# ---- expert_combine: SwitchGLU._combine on Metal = copy (astype), Multiply, col_reduce_small (U = T), Add.

def expert_combine_stock():
    """The stock kernels' text: Multiply / Add, Sum, col_reduce_small and the utils it calls."""
    return (excerpt("binary_ops.h", "struct Add {") + excerpt("binary_ops.h", "struct Multiply {")
            + "static constant constexpr const uint8_t simd_size = 32;\n" + macro("reduction/ops.h", "DEFINE_SIMD_REDUCE")
            + excerpt("reduction/ops.h", "struct Sum {")
            + excerpt("utils.h", "METAL_FUNC IdxT elem_to_loc(\n    IdxT elem,")
            + excerpt("utils.h", "struct LoopedElemToLoc {")
            + excerpt("utils.h", "struct LoopedElemToLoc<1, OffsetT, true> {")
            + excerpt("utils.h", "struct LoopedElemToLoc<1, OffsetT, false> {")
            + excerpt("reduction/reduce_col.h", "[[kernel]] void col_reduce_small("))


EXPERT_COMBINE = r"""
%(stock)s
%(twin)s
int main(int argc, char** argv) {
  using T = %(T)s;
  constexpr int R = %(R)d, K = %(K)d, H = %(H)d;
  auto routed = load<T>(argv[1], R * K * H);
  auto weights = load<float>(argv[2], R * K);
  auto shared = load<T>(argv[3], R * H);
  std::vector<int64_t> sizes{R};
  // Stock. astype: MLX's copy kernel, static_cast to the model dtype.
  std::vector<T> w(R * K), prod(R * K * H), sum(R * H), out(R * H), twin(R * H);
  for (int i = 0; i < R * K; ++i) w[i] = static_cast<T>(weights[i]);
  for (int i = 0; i < R * K * H; ++i) prod[i] = Multiply()(routed[i], w[i / H]);
  // strided_reduce_small (backend/metal/reduce.cpp): reduction_size K, stride H, one
  // reduced dimension (NDIMS 1), threadgroup (min(H / 4, 32), min(8, K)), one column of threadgroups per output row.
  const size_t reduction_size = K;
  const int64_t reduction_stride = H;
  const int shape[1] = {R}, reduce_shape[1] = {K};
  const int64_t strides[1] = {int64_t(K) * H}, reduce_strides[1] = {H};
  const int ndim = 1, reduce_ndim = 1;
  const size_t non_col_reductions = 1;
  const uint tx = H / 4 < 32 ? H / 4 : 32, ty = K < 8 ? K : 8;
  msl_run({(H / 4 + tx - 1) / tx * tx, uint(R) * ty, 1}, {tx, ty, 1}, [&] {
    uint3 gid = __msl.threadgroup_position_in_grid;
    col_reduce_small<T, T, Sum<T>, int, 1>(prod.data(), sum.data(), reduction_size, reduction_stride, shape,
        strides, ndim, reduce_shape, reduce_strides, reduce_ndim, non_col_reductions, uint3{gid.x, gid.y, 0},
        uint3{__msl.threadgroups_per_grid.x, __msl.threadgroups_per_grid.y, 1}, __msl.thread_position_in_threadgroup,
        __msl.threads_per_threadgroup);
  });
  for (int i = 0; i < R * H; ++i) out[i] = Add()(sum[i], shared[i]);
  // The twin, as the patch launches it.
  msl_run({uint(%(grid)d), 1, 1}, {uint(%(threads)d), 1, 1}, [&] { %(call)s; });
  save(argv[4], out);
  save(argv[5], twin);
  return 0;
}
"""


def expert_combine(tmp, routed, weights, shared, twin_source=None):
    """(stock's bits, the twin's bits) for ``SwitchGLU._combine(routed, weights, shared)``, emulated."""
    from glm53_patches.patches.expert_combine import kernel

    from . import source

    rows, _, k, hidden = routed.shape
    if twin_source is None:
        with source.verbose_kernels():
            (twin_source,) = source.generated(lambda r, w, s: kernel.expert_combine(r, w, s, backend="metal"),
                                              routed, weights, shared)
    total = rows * hidden
    program = PRELUDE + EXPERT_COMBINE % {
        "stock": expert_combine_stock(), "twin": twin_source, "T": _host_type(routed.dtype), "R": rows, "K": k,
        "H": hidden, "grid": -(-total // kernel.THREADS) * kernel.THREADS, "threads": kernel.THREADS,
        "call": launch(twin_source, {"routed": "routed.data()", "weights": "weights.data()", "shared": "shared.data()",
                                     "sizes": "sizes.data()", "out": "twin.data()"}),
    }
    paths = [tmp / n for n in ("routed", "weights", "shared", "stock", "twin")]
    for array, path in zip((routed, weights, shared), paths):
        to_file(array, path)
    build_and_run(tmp, program, paths)
    bits = np.uint16 if routed.dtype in (mx.bfloat16, mx.float16) else np.uint32
    return np.fromfile(paths[3], bits), np.fromfile(paths[4], bits)
