"""Two questions for the H200, answered in seconds (fifth session, before designing more kernels):

1. In which order does MLX's CUDA depthwise conv (cuDNN) add the K products of
   glm5_next's short conv? Each product of two bf16 values is exact in
   float32, so only the order of the float32 sums (and the final rounding to
   bf16) can differ: compared with numpy emulations of candidate orders.
2. Does an ``mx.fast.cuda_kernel`` run inside ``mx.compile``?
"""

import mlx.core as mx
import numpy as np


def bf16_round(a):
    """float32 -> nearest-even bf16, as float32."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def orders(p):
    """Candidate float32 sums of the products p [..., K]."""
    f = np.float32
    k = p.shape[-1]
    asc = np.zeros(p.shape[:-1], f)
    for j in range(k):
        asc = (asc + p[..., j]).astype(f)
    desc = np.zeros(p.shape[:-1], f)
    for j in reversed(range(k)):
        desc = (desc + p[..., j]).astype(f)
    pair = ((p[..., 0] + p[..., 1]).astype(f) + (p[..., 2] + p[..., 3]).astype(f)).astype(f)
    exact = p.astype(np.float64).sum(-1)
    return {"ascending": asc, "descending": desc, "pairwise": pair, "float64 then round": exact.astype(f)}


def conv_probe():
    channels, k = 24576, 4
    for batch, scale in ((1, 1.0), (3, 1.0), (1, 30.0)):
        x = (scale * mx.random.normal((batch, k, channels))).astype(mx.bfloat16)
        w = (0.5 * mx.random.normal((channels, k, 1))).astype(mx.bfloat16)
        y = mx.conv1d(x, w, groups=channels)  # [B, 1, C]
        mx.eval(y)
        xn = np.array(x.astype(mx.float32))
        wn = np.array(w.astype(mx.float32))[:, :, 0]  # [C, K]
        p = (xn.transpose(0, 2, 1) * wn[None]).astype(np.float32)  # [B, C, K], exact
        got = np.array(y.astype(mx.float32))[:, 0, :]
        for name, s in orders(p).items():
            match = np.mean(bf16_round(s) == got)
            print(f"conv B={batch} scale={scale}: {name:>18}: {match:.6f} of {got.size} values match")


def compile_probe():
    source = "unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n[0]) out[i] = inp[i] * 2.0f;"
    kernel = mx.fast.cuda_kernel(name="probe_double", input_names=["inp", "n"], output_names=["out"], source=source)

    def f(a):
        b = a + 1
        (c,) = kernel(inputs=[b, mx.array([b.size], mx.int32)], grid=(b.size, 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=[b.shape], output_dtypes=[b.dtype])
        return c - 1

    a = mx.arange(1000, dtype=mx.float32)
    try:
        got = mx.compile(f)(a)
        mx.eval(got)
        print("cuda_kernel inside mx.compile:", "works" if mx.array_equal(got, 2 * (a + 1) - 1).item() else "WRONG")
    except Exception as exc:
        print("cuda_kernel inside mx.compile: fails:", repr(exc)[:300])


if __name__ == "__main__":
    print(mx.__version__, mx.default_device())
    conv_probe()
    compile_probe()
