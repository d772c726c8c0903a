"""Every hand-written GPU kernel is made here, once per process and backend, and the constant a compiled kernel reads.

A kernel module declares its CUDA and Metal twins as data (source, header
and, where they differ, input names) and asks ``gpu_kernel`` for the one of
the backend it runs on. Staged upstream modules get a copy of what they use.
"""

import functools

import mlx.core as mx

_built = {}  # (name, backend) -> the kernel MLX made


def gpu_kernel(name, backend, inputs, outputs, cuda=None, metal=None, ensure_row_contiguous=True):
    """The kernel ``name`` for ``backend`` ('cuda' or 'metal'), made on first use.

    ``cuda`` / ``metal``: that twin as ``(source, header)`` or ``(source,
    header, input names)`` (when they differ from ``inputs``); None where
    there is none. Raises ValueError for a backend without a twin.
    """
    kernel = _built.get((name, backend))
    if kernel is None:
        twin = {"cuda": cuda, "metal": metal}.get(backend)
        if twin is None:
            raise ValueError(f"no {name} kernel for backend {backend!r}")
        source, header, *names = twin
        make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
        extra = {"header": header} if header else {}
        kernel = make(name=name, input_names=list(names[0] if names else inputs), output_names=list(outputs),
                      source=source, ensure_row_contiguous=ensure_row_contiguous, **extra)
        _built[(name, backend)] = kernel
    return kernel


def forget_kernels(name=None):
    """Drop the made kernels (those called ``name``, or all): they are made again on next use."""
    for key in [k for k in _built if name is None or k[0] == name]:
        del _built[key]


@functools.lru_cache(maxsize=16)
def compiled_constant(value: float) -> float:
    """The float32 that an ``mx.compile``d kernel reads for a captured Python float.

    MLX prints captured scalar constants into the generated kernel source
    (``print_float_constant``). Releases that print 7 significant digits bake
    e.g. 1/3 as 0.3333333 (1 ulp off); 0.32.4 prints 9, which round-trips.
    Rather than assume either, ask this MLX: compile ``|a| * value`` (two ops,
    so they fuse and the constant is printed) and run it on ``a = 1``. Call it
    outside any ``mx.compile`` trace (it evaluates).
    """
    probe = mx.compile(lambda a: mx.abs(a) * value)
    return probe(mx.ones((1,), dtype=mx.float32)).item()
