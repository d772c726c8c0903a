"""Compile block_qmv's CUDA instantiations in parallel, into MLX_PTX_CACHE_DIR, before a verify or a timed run.

MLX builds a custom kernel's instantiation with NVRTC on the calling thread
the first time it launches, and keeps the PTX in ``MLX_PTX_CACHE_DIR`` under
the kernel's name and a hash of its generated source (template arguments,
input dtypes). block_qmv's kernel includes cutlass headers and is a template
on dtype, bits, group, K, positions and launch shape: a cold ``verify
block_qmv`` meets about a hundred of them one after another, and did not end
inside 430 s (s43). Here each is launched once, at 8 output rows (N is not a
template argument), ``--jobs`` processes at a time, and each one's seconds
are printed: what a cold verify or timed process would have spent.

The instantiations: verify's op cases; the tiny models' projections that
``linear.unsupported`` gives the kernel at 2 to 8 positions (verify's
variants: bf16, 8/6/4-bit, hidden 512, GPU widths); and each real-width
projection (exact_qmv's verify list) at ``--real-positions``.

``--tiny-models`` also runs stock's tiny-model checks of ``verify
block_qmv`` (8, 6 and 4 bits; batch 1 and 2; greedy decode and verify
blocks), one process each: a cold verify spent minutes compiling MLX's own
kernels for them, one after another, and was cut off there (s44, s45).

    python precompile_block_qmv.py [--jobs 12] [--real-positions 2,3,4] [--tiny-models]
"""

import argparse
import json
import subprocess
import sys
import time


def instantiations(real_positions):
    """(dtype name, bits, group, K, positions, launch) for each instantiation, deduplicated, in a fixed order."""
    import mlx.core as mx
    import mlx.nn as nn

    from glm53_patches import tiny_model
    from glm53_patches.exactness import _served_dtype
    from glm53_patches.patches.block_qmv.checks import verify
    from glm53_patches.patches.block_qmv.linear import unsupported
    from glm53_patches.patches.exact_qmv.checks.verify import REAL

    found = []
    for _, _, k, bits, group, dtype, positions, launch in verify.OTHER + verify.NARROW:
        found.append((str(dtype), bits, group, k, positions, launch))
    for _, _, k, bits in REAL:
        for positions in sorted({4, *real_positions} | ({2, 8} if k % 512 else set())):  # verify's op positions too
            found.append(("mlx.core.bfloat16", bits, 64, k, positions, {}))
    config = {**tiny_model.gpu_widths(), "hidden_size": 512}
    for bits in (8, 6, 4):
        model = _served_dtype(tiny_model.build_model(seed=1, quantize_bits=bits, **config), mx.bfloat16)
        for _, module in model.language_model.named_modules():
            if type(module) is not nn.QuantizedLinear:
                continue
            k = module["weight"].shape[1] * 32 // module.bits
            for positions in range(2, 9):
                x = mx.zeros((1, positions, k), dtype=mx.bfloat16)
                if unsupported(module, x, "cuda") is None:
                    found.append(("mlx.core.bfloat16", module.bits, module.group_size, k, positions, {}))
    unique = []
    for item in found:
        if item not in unique:
            unique.append(item)
    return unique


def compile_share(items):
    """Launch each instantiation once at 8 rows; print its seconds (the first launch compiles)."""
    import mlx.core as mx

    from glm53_patches.patches.block_qmv import kernel

    for dtype_name, bits, group, k, positions, launch in items:
        dtype = getattr(mx, dtype_name.rsplit(".", 1)[-1])
        w = mx.zeros((8, k * bits // 32), dtype=mx.uint32)
        scales = mx.ones((8, k // group), dtype=dtype)
        x = mx.zeros((positions, k), dtype=dtype)
        start = time.perf_counter()
        mx.eval(kernel.block_qmv(x, w, scales, scales, bits, group, backend="cuda", **launch))
        print(f"{time.perf_counter() - start:7.1f} s  {dtype_name} {bits}-bit g{group} K={k} P={positions} {launch}",
              flush=True)


def run_tiny_model(bits, batch, blocks):
    """Stock's run of one of verify's tiny-model checks (the kernels it compiles stay in the cache)."""
    import mlx.core as mx

    from glm53_patches import tiny_model
    from glm53_patches.exactness import _served_dtype, tiny_prompts

    start = time.perf_counter()
    config = {**tiny_model.gpu_widths(), "hidden_size": 512}  # verify's (check_tiny_models)
    model = _served_dtype(tiny_model.build_model(seed=1, quantize_bits=bits, **config), mx.bfloat16)
    tokens = tiny_prompts()[batch]
    if blocks:
        mx.eval(tiny_model.speculative_outputs(model.language_model, tokens))
    else:
        mx.eval(tiny_model.greedy_logits(model.language_model, tokens, 4))
    print(f"{time.perf_counter() - start:7.1f} s  tiny model {bits}-bit B={batch}{' blocks' if blocks else ''}",
          flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--real-positions", default="2,3,4")
    parser.add_argument("--tiny-models", action="store_true", help="also warm stock's tiny-model checks")
    parser.add_argument("--share", help=argparse.SUPPRESS)  # a child's list, as JSON
    parser.add_argument("--tiny", help=argparse.SUPPRESS)  # a child's (bits, batch, blocks), as JSON
    args = parser.parse_args()
    if args.share:
        compile_share([tuple(item) for item in json.loads(args.share)])
        return
    if args.tiny:
        run_tiny_model(*json.loads(args.tiny))
        return
    start = time.perf_counter()
    items = instantiations([int(p) for p in args.real_positions.split(",")])
    print(f"{len(items)} instantiations, {args.jobs} processes", flush=True)
    children = [subprocess.Popen([sys.executable, __file__, "--share", json.dumps(items[i :: args.jobs])])
                for i in range(args.jobs)]
    if args.tiny_models:
        children += [subprocess.Popen([sys.executable, __file__, "--tiny", json.dumps([bits, batch, blocks])])
                     for bits in (8, 6, 4) for batch in (1, 2) for blocks in (False, True)]
    failed = sum(child.wait() != 0 for child in children)
    print(f"done in {time.perf_counter() - start:.1f} s, {failed} processes failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
