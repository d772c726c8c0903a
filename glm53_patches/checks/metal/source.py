"""The Metal source MLX builds for a kernel launch, taken from MLX itself.

``mx.fast.metal_kernel(...)(..., verbose=True)`` prints the source MLX
generates (``mlx/backend/common/metal_kernel.cpp``: the header, the
signature with each input's address space (``constant`` under 8 elements),
the thread attributes the body names, the template instantiation). Under
``mx.export_function`` the Linux CPU wheel gets that far without a GPU, so
``generated(fn, *args)`` traces ``fn`` and returns every source printed.
MLX compiles ``metal::utils()`` (its kernels/utils.h) before that text; the
shim (``msl.h``) stands in for the part of it the kernels use.
"""

import contextlib
import os
import re
import sys
import tempfile

import mlx.core as mx

_PRINTED = re.compile(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```\n", re.S)


@contextlib.contextmanager
def _stdout_to(path):
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def pretend_metal():
    """Within: ``mx.metal.is_available()`` and ``mx.default_device() == mx.gpu`` read True.

    mlx-vlm builds and picks its Metal kernels behind these two checks; only
    Python sees the change (nothing runs: the launches are traced).
    """
    available, default = mx.metal.is_available, mx.default_device
    mx.metal.is_available, mx.default_device = (lambda: True), (lambda: mx.gpu)
    try:
        yield
    finally:
        mx.metal.is_available, mx.default_device = available, default


@contextlib.contextmanager
def verbose_kernels():
    """Within: every ``mx.fast.metal_kernel`` built prints its source at each launch; the patches build theirs anew.

    mlx-vlm's own Metal kernels (gated delta, hyper-connections) are rebuilt
    the same way, as their modules build them on a Mac
    (under ``pretend_metal``).
    """
    from mlx_vlm.models import gated_delta as gd
    from mlx_vlm.models.deepseek_v4 import hyper_connection as hc

    from glm53_patches.kernels.build import forget_kernels

    real = mx.fast.metal_kernel

    def metal_kernel(**kwargs):
        kernel = real(**kwargs)
        return lambda **call: kernel(**call, verbose=True)

    upstream = {
        (gd, "_gated_delta_kernel"): lambda: gd._make_gated_delta_kernel(),
        (gd, "_gated_delta_kernel_masked"): lambda: gd._make_gated_delta_kernel(has_mask=True),
        (gd, "_gated_delta_kernel_vec"): lambda: gd._make_gated_delta_kernel(vectorized=True),
        (gd, "_gated_delta_kernel_vec_masked"): lambda: gd._make_gated_delta_kernel(has_mask=True, vectorized=True),
        (hc, "_hc_sinkhorn_collapse_kernel"): hc._make_hc_sinkhorn_collapse_kernel,
        (hc, "_hc_sinkhorn_split_kernel"): hc._make_hc_sinkhorn_split_kernel,
    }
    saved = {key: getattr(*key) for key in upstream}
    forget_kernels()
    mx.fast.metal_kernel = metal_kernel
    try:
        with pretend_metal():
            for (module, name), make in upstream.items():
                setattr(module, name, make())
        yield
    finally:
        mx.fast.metal_kernel = real
        for (module, name), value in saved.items():
            setattr(module, name, value)
        forget_kernels()


def generated(fn, *args):
    """The Metal sources MLX generates while tracing ``fn(*args)`` (call inside ``verbose_kernels``)."""
    with tempfile.TemporaryDirectory() as tmp:
        printed = os.path.join(tmp, "stdout")
        with _stdout_to(printed):
            mx.export_function(os.path.join(tmp, "trace.mlxfn"), fn, *args)
        with open(printed) as f:
            return _PRINTED.findall(f.read())
