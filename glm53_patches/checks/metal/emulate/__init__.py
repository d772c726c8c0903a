"""Differential emulation: each exact Metal twin and the stock Metal kernels it must match, on the same inputs.

Both sides are compiled as C++ with g++ through the same shim (``msl.h``,
emulation mode: each threadgroup's threads are host threads; ``simd_sum``,
``simd_shuffle`` and ``simd_ballot`` exchange real values between them;
``metal::fast::exp`` and a bare ``exp`` are not ``metal::precise::exp``),
run in one program, and their outputs compared bit for bit. The twin is the
source MLX generates for it (``source.generated``). Stock is MLX 0.32.4's
own kernel text, read at run time from the headers the installed mlx wheel
ships (``mlx/include/mlx/backend/metal/kernels``; ``excerpt``), the two .metal
kernels it does not ship from ``mlx_kernels.metal`` (``snapshot``), and
mlx-vlm's own Metal kernels as MLX generates them; each launched with the
parameters MLX's dispatch gives it (cited where used). A stock path that is
a chain of MLX ops runs each op's Metal kernel (or functor) in order.

One module per twin: ``expert_combine``, ``router_select``,
``fused_kda_kernel``, ``hc_decode``, ``dsa_decode``, ``block_qmv``; each has ``run(...)``
returning ``{output: (stock bits, twin bits)}``.

What this cannot show (a Mac can): the Metal compiler's fma contraction (g++
here does not contract, -ffp-contract=off, unless ``contract=True``, where
it contracts both sides as it sees fit), the hardware's own ``simd_sum``
order (both sides use the same one here; ``simd_order`` picks among three),
bfloat arithmetic other than "in float, rounded to nearest even", the
hardware's fast exp, and pipeline thread and threadgroup-memory limits.
"""

import atexit
import functools
import hashlib
import pathlib
import re
import shutil
import subprocess
import tempfile

import numpy as np

import mlx.core as mx

from glm53_patches.kernels.mlx_metal import HEADERS, declaration, declaration_in

from .. import typecheck

SNAPSHOT = pathlib.Path(__file__).with_name("mlx_kernels.metal")


def excerpt(path, start):
    """From ``path`` (under the installed MLX kernels), the declaration that begins at the line ``start``, verbatim
    (``kernels.mlx_metal.declaration``, as the twins read MLX's helpers), headed by a line naming its source."""
    return f"// MLX 0.32.4, mlx/backend/metal/kernels/{path} (installed headers), verbatim\n" + declaration(path, start)


def snapshot(start):
    """The declaration of ``mlx_kernels.metal`` (MLX .metal kernels the wheel does not ship) that begins at ``start``."""
    return f"// {SNAPSHOT.name} (ml-explore/mlx 846d176), verbatim\n" + declaration_in(SNAPSHOT.read_text(), start)


def header(path):
    """A whole installed MLX kernel header, verbatim."""
    return f"// MLX 0.32.4, mlx/backend/metal/kernels/{path} (installed headers), verbatim\n" + (HEADERS / path).read_text()


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
    at = source.index("[[kernel]] void ")
    signature = source[at:source.index(") {\n", at) + 3]
    args = []
    for _, name, attribute, _ in _PARAM.findall(signature):
        args.append(buffers[name] if attribute == "buffer" else f"__msl.{attribute}")
    return f"{instance}({', '.join(args)})"


def generated(fn, *args):
    """The one Metal source MLX generates for ``fn(*args)``, with every kernel (ours, mlx-vlm's) built for Metal."""
    from .. import source

    with source.verbose_kernels():
        (text,) = source.generated(fn, *args)
    return text


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
// Outputs start as a poison pattern, one per side (STOCK, TWIN): an element
// neither side writes differs.
enum { STOCK = 0xa5, TWIN = 0x5a };
template <class X> std::vector<X> poisoned(size_t n, int byte) {
  std::vector<X> a(n);
  std::memset(static_cast<void*>(a.data()), byte, n * sizeof(X));
  return a;
}
template <class X> void save(const char* path, const std::vector<X>& a) {
  FILE* f = std::fopen(path, "wb");
  std::fwrite(a.data(), sizeof(X), a.size(), f);
  std::fclose(f);
}
"""

_BUILDS = pathlib.Path(tempfile.mkdtemp(prefix="glm53-metal-emulation-"))
atexit.register(shutil.rmtree, _BUILDS, ignore_errors=True)


# -U_FORTIFY_SOURCE: the fibers' _longjmp between stacks is what its checked longjmp refuses.
_FLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE", "-w")


@functools.lru_cache(maxsize=None)
def _std_header(flags):
    """msl_std.h precompiled with ``flags`` (the C++ library headers are most of a build's time)."""
    folder = _BUILDS / hashlib.sha256(repr(flags).encode()).hexdigest()[:16]
    folder.mkdir()
    (folder / "msl_std.h").write_text(typecheck.SHIM.with_name("msl_std.h").read_text())
    subprocess.run(["g++", *_FLAGS, *flags, "-x", "c++-header", str(folder / "msl_std.h"), "-o",
                    str(folder / "msl_std.h.gch")], check=True)
    return folder


@functools.lru_cache(maxsize=None)
def _build(text, flags):
    name = hashlib.sha256((text + repr(flags)).encode()).hexdigest()[:16]
    cpp, binary = _BUILDS / f"{name}.cpp", _BUILDS / name
    cpp.write_text('#include "msl_std.h"\n' + text)
    subprocess.run(["g++", *_FLAGS, *flags, f"-I{_std_header(flags)}", "-o", str(binary), str(cpp)], check=True)
    return binary


def build(program, simd_order=0, reverse=False, contract=False):
    """``program`` (MSL through the shim, emulation mode) compiled with g++; built once per text and flags.

    simd_order: the shim's ``simd_sum`` order (0 butterfly, 1 from lane 0,
    2 from lane 31). reverse: run each threadgroup's threads in reverse
    index order. contract: let g++ contract ``a * b + c`` into fmas
    (``-ffp-contract=fast -mfma``), on both sides alike.
    """
    defines = (f"MSL_SIMD_SUM_ORDER={simd_order}", f"MSL_REVERSE_SCHEDULE={int(reverse)}", "MSL_STD_INCLUDED")
    text = typecheck.expand(program, typecheck=False, defines=defines)
    # g++ forms fmas in a pass that -O2 runs, not -O1.
    return _build(text, ("-O2", "-ffp-contract=fast", "-mfma") if contract else ("-ffp-contract=off",))


def execute(tmp, program, inputs, outputs, timeout=600, **build_options):
    """Build ``program`` and run it: argv holds ``inputs`` (name -> array, as files) then ``outputs``' files.

    outputs: {name: numpy dtype of the bits the program writes}. Returns
    {name: numpy array of those bits}.
    """
    binary = build(program, **build_options)
    paths = []
    for name, array in inputs.items():
        paths.append(tmp / f"in_{name}")
        to_file(array, paths[-1])
    out_paths = [tmp / f"out_{name}" for name in outputs]
    for path in out_paths:
        path.unlink(missing_ok=True)
    subprocess.run([str(binary), *map(str, paths + out_paths)], check=True, timeout=timeout)
    return {name: np.fromfile(path, dtype) for (name, dtype), path in zip(outputs.items(), out_paths)}


def pairs(found, names):
    """{name: (stock bits, twin bits)} from ``execute``'s ``stock_<name>`` and ``twin_<name>`` outputs."""
    return {n: (found[f"stock_{n}"], found[f"twin_{n}"]) for n in names}


def host_type(dtype):
    """The shim's C++ type for an MLX dtype."""
    return {mx.float32: "float", mx.bfloat16: "bfloat", mx.float16: "half", mx.int32: "int", mx.bool_: "bool",
            mx.uint32: "uint"}[dtype]


def bits_dtype(dtype):
    """The numpy type of an MLX dtype's bits."""
    return {mx.float32: np.uint32, mx.bfloat16: np.uint16, mx.float16: np.uint16, mx.int32: np.int32,
            mx.bool_: np.uint8, mx.uint32: np.uint32}[dtype]


def to_file(array, path):
    """An MLX or numpy array's bits, row-major, into ``path`` (bool as one byte)."""
    if isinstance(array, np.ndarray):
        (array.astype(np.uint8) if array.dtype == np.bool_ else np.ascontiguousarray(array)).tofile(path)
        return
    array = mx.contiguous(array)
    if array.dtype in (mx.bfloat16, mx.float16):
        np.array(array.view(mx.uint16)).tofile(path)
    elif array.dtype == mx.bool_:
        np.array(array).astype(np.uint8).tofile(path)
    else:
        np.array(array).tofile(path)


def differences(result):
    """{output: how many of its elements differ} for ``run``'s result; empty when stock and twin agree bit for bit."""
    found = {}
    for name, (stock, twin) in result.items():
        if stock.shape != twin.shape:
            found[name] = f"shapes {stock.shape} and {twin.shape}"
        elif (stock != twin).any():
            found[name] = int((stock != twin).sum())
    return found


# ---- MLX's argsort on Metal (stock's argpartition: ArgPartition::eval_gpu calls gpu_merge_sort).

def sort_dispatch(size, itemsize=4):
    """(bn, tn, n_blocks) for a row of ``size`` values, as mlx/backend/metal/sort.cpp's gpu_merge_sort picks them.

    Read in ml-explore/mlx 846d176 (the .cpp is not in the wheel; the wheel's
    kernels/sort.h, which it launches, is identical to that commit's).
    """
    tn = 4
    potential_bn = (size + tn - 1) // tn
    bn = next((b for limit, b in ((256, 512), (128, 256), (64, 128), (32, 64)) if potential_bn > limit), 32)
    if bn == 512 and itemsize > 4:
        bn = 256
    return bn, tn, -(-size // (bn * tn))


def sort_text():
    """kernels/sort.h whole, and the utils.h function it calls."""
    return excerpt("utils.h", "METAL_FUNC IdxT elem_to_loc(\n    IdxT elem,") + header("sort.h")


# Rows of SIZE contiguous values argsorted along the row, as gpu_merge_sort
# launches sort.h: one block (single_block_sort: "carg_block_sort", bn
# threads per row) or several (multi_block_sort: mb_block_sort, then
# partition and merge passes while merge_tiles / 2 < n_blocks, ping-ponging
# two buffers, then a copy of the last indices out).
ARGSORT = r"""
template <class T, short BN, short TN, int NB>
void mlx_argsort(const T* in, uint* out, int rows, int size) {
  const int size_sorted_axis = size, stride_one = 1;
  if constexpr (NB == 1) {
    const int segment = size;
    msl_run({uint(BN), uint(rows), 1}, {uint(BN), 1, 1}, [&] {
      block_sort<T, uint32_t, true, BN, TN>(in, out, size_sorted_axis, stride_one, stride_one, segment, segment,
          __msl.threadgroup_position_in_grid, __msl.thread_position_in_threadgroup);
    });
  } else {
    std::vector<T> vals[2] = {std::vector<T>(size_t(rows) * size), std::vector<T>(size_t(rows) * size)};
    std::vector<uint> idxs[2] = {std::vector<uint>(size_t(rows) * size), std::vector<uint>(size_t(rows) * size)};
    std::vector<uint> partitions(size_t(rows) * (NB + 1));
    const int nc_dim = 1, nc_shape[1] = {rows}, n_blocks = NB;
    const int64_t nc_strides[1] = {size};
    msl_run({uint(NB * BN), uint(rows), 1}, {uint(BN), 1, 1}, [&] {
      mb_block_sort<T, uint, true, BN, TN>(in, vals[0].data(), idxs[0].data(), size_sorted_axis, stride_one, nc_dim,
          nc_shape, nc_strides, __msl.threadgroup_position_in_grid, __msl.thread_position_in_threadgroup);
    });
    bool ping = false;
    const uint partition_threads = NB + 1 < 1024 ? NB + 1 : 1024;
    for (int merge_tiles = 2; (merge_tiles / 2) < NB; merge_tiles *= 2) {
      const int from = ping ? 1 : 0, to = ping ? 0 : 1;
      ping = !ping;
      msl_run({partition_threads, uint(rows), 1}, {partition_threads, 1, 1}, [&] {
        mb_block_partition<T, uint, true, BN, TN>(partitions.data(), vals[from].data(), idxs[from].data(),
            size_sorted_axis, merge_tiles, n_blocks, __msl.threadgroup_position_in_grid,
            __msl.thread_position_in_threadgroup, __msl.threads_per_threadgroup);
      });
      msl_run({uint(NB * BN), uint(rows), 1}, {uint(BN), 1, 1}, [&] {
        mb_block_merge<T, uint, true, BN, TN>(partitions.data(), vals[from].data(), idxs[from].data(),
            vals[to].data(), idxs[to].data(), size_sorted_axis, merge_tiles, n_blocks,
            __msl.threadgroup_position_in_grid, __msl.thread_position_in_threadgroup);
      });
    }
    std::memcpy(out, idxs[ping ? 1 : 0].data(), sizeof(uint) * size_t(rows) * size);
  }
}
"""


def argsort_call(type_name, size, rows_expr, in_expr, out_expr, itemsize=4):
    """The C++ call that argsorts ``rows`` rows of ``size`` values as MLX's Metal sort does."""
    bn, tn, blocks = sort_dispatch(size, itemsize)
    return f"mlx_argsort<{type_name}, {bn}, {tn}, {blocks}>({in_expr}, {out_expr}, {rows_expr}, {size})"
