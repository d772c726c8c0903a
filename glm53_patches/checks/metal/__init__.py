"""Checks of the Metal kernels that run without a Mac (test harness; nothing here runs in a server).

* ``source``: the Metal source MLX builds for a launch, from MLX itself
  (``verbose=True`` under ``mx.export_function`` on the Linux CPU wheel);
* ``msl.h``: the shim that lets clang and g++ read MSL (address spaces,
  bfloat's conversions, SIMD-group functions; an emulation runtime);
* ``typecheck``: clang (libclang) type-checks each source as MSL;
* ``cases``: every launch checked (verify's shapes and edge shapes, and
  upstream's own Metal kernels);
* ``emulate``: each exact twin and the stock Metal kernels it must match
  (MLX's and mlx-vlm's own text, op by op where stock is a chain), run on
  the host through the shim on the same inputs and compared bit for bit.

Run ``python -m glm53_patches.checks.metal.typecheck [KERNEL ...]``;
the tests are tests/metal/. Needs g++ and the ``libclang`` package.
"""
