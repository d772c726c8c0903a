"""Is prefill's quantized matmul on MLX CUDA worth replacing by dequantize + a
bf16 matmul? One 2,048-token chunk at GLM-5.3-Flash's widths, per projection:
stock's quantized call vs dequantizing the weight first, interleaved rounds,
with the largest difference of the outputs. Prints as it goes."""

import statistics
import sys
import time

import mlx.core as mx

from glm53_patches.bench.measure import _median_time

M, HIDDEN, MOE, EXPERTS, TOPK = 2048, 4096, 2048, 64, 8


def timed(fn):
    """Median ms of 5 calls after one warm-up (mx.eval returns once the result is computed)."""
    return _median_time(fn, 5, warm=1) * 1e3


def quantized(shape, bits, key):
    w = (mx.random.normal(shape, key=key) * 0.02).astype(mx.bfloat16)
    return mx.quantize(w, group_size=64, bits=bits)


def dense(rows, bits):
    x = mx.random.normal((M, HIDDEN), key=mx.random.key(1)).astype(mx.bfloat16)
    w, s, b = quantized((rows, HIDDEN), bits, mx.random.key(2))
    mx.eval(x, w, s, b)
    stock = lambda: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)  # noqa: E731
    deq = lambda: x @ mx.dequantize(w, s, b, group_size=64, bits=bits).T  # noqa: E731
    return f"dense {rows}x{HIDDEN} {bits}-bit", stock, deq


def experts(rows, cols, bits):
    idx = mx.sort(mx.random.randint(0, EXPERTS, (M * TOPK,), key=mx.random.key(3)))
    x = mx.random.normal((M * TOPK, 1, cols), key=mx.random.key(4)).astype(mx.bfloat16)
    w, s, b = quantized((EXPERTS, rows, cols), bits, mx.random.key(5))
    mx.eval(idx, x, w, s, b)
    stock = lambda: mx.gather_qmm(x, w, s, b, rhs_indices=idx, transpose=True, group_size=64,  # noqa: E731
                                  bits=bits, sorted_indices=True)
    deq = lambda: mx.gather_mm(x, mx.dequantize(w, s, b, group_size=64, bits=bits).swapaxes(-1, -2),  # noqa: E731
                               rhs_indices=idx, sorted_indices=True)
    return f"experts {EXPERTS}x{rows}x{cols} {bits}-bit, {M * TOPK} rows", stock, deq


def main():
    print(mx.__version__, mx.default_device(), flush=True)
    cases = [dense(3 * 8192, 8), dense(4096, 8), dense(8192, 6), experts(MOE, HIDDEN, 4), experts(HIDDEN, MOE, 4)]
    for name, stock, deq in cases:
        t0 = time.perf_counter()
        a, b = stock(), deq()
        mx.eval(a, b)
        diff = mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
        ref = mx.max(mx.abs(a.astype(mx.float32))).item()
        first = time.perf_counter() - t0
        rounds = [(timed(stock), timed(deq)) for _ in range(3)]
        s = statistics.median(r[0] for r in rounds)
        d = statistics.median(r[1] for r in rounds)
        print(f"{name}: quantized {s:.2f} ms, dequantize+matmul {d:.2f} ms ({s / d:.2f}x); "
              f"max |diff| {diff:.3g} of max |out| {ref:.3g}; first call {first:.1f} s", flush=True)
        print("   rounds", [(round(x, 2), round(y, 2)) for x, y in rounds], flush=True)


if __name__ == "__main__":
    sys.exit(main())
