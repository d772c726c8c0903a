"""Which order does MLX's CUDA depthwise conv (cuDNN) add glm5_next's 4 conv products in?

Random inputs cannot tell (probe_conv.py: every candidate order matched all
values). Here each channel's products are a permutation of
[2^24, 1, 1, -2^24] (each exact: 2^12 * 2^12 and 1 * 1), for which the
float32 sum is 0, 1 or 2 depending on the order of the additions.

A verify block convolves L > 1 positions (the window's K - 1 plus L inputs);
cuDNN may pick another engine there. Each channel then sets its pattern at one
output position (channel c at position c % L; the other positions of that
channel are not compared).
"""

import itertools

import mlx.core as mx
import numpy as np

K = 4
BIG = 2.0**12


def candidates(p):
    f = np.float32
    out = {}
    for name, order in (("ascending", range(K)), ("descending", reversed(range(K)))):
        s = np.zeros(p.shape[:-1], f)
        for j in order:
            s = (s + p[..., j]).astype(f)
        out[name] = s
    out["(0+1)+(2+3)"] = ((p[..., 0] + p[..., 1]).astype(f) + (p[..., 2] + p[..., 3]).astype(f)).astype(f)
    out["(0+2)+(1+3)"] = ((p[..., 0] + p[..., 2]).astype(f) + (p[..., 1] + p[..., 3]).astype(f)).astype(f)
    out["exact"] = p.astype(np.float64).sum(-1).astype(f)
    return out


def main():
    print(mx.__version__, mx.default_device())
    patterns = sorted(set(itertools.permutations([0, 1, 2, 3])))  # positions of BIG, 1, 1, -BIG
    channels = 24576
    rng = np.random.default_rng(0)
    for length in range(1, 9):
        for batch in (1, 2, 3, 8):
            pick = rng.integers(0, len(patterns), channels)
            at = np.arange(channels) % length  # the output position each channel's pattern is set at
            x = np.zeros((batch, K - 1 + length, channels), np.float32)
            w = np.zeros((channels, K), np.float32)
            for c in range(channels):
                big, one_a, one_b, neg = patterns[pick[c]]
                t = at[c]
                x[:, t + big, c], w[c, big] = BIG, BIG
                x[:, t + one_a, c], w[c, one_a] = 1.0, 1.0
                x[:, t + one_b, c], w[c, one_b] = 1.0, 1.0
                x[:, t + neg, c], w[c, neg] = -BIG, BIG
            y = mx.conv1d(mx.array(x).astype(mx.bfloat16), mx.array(w[:, :, None]).astype(mx.bfloat16), groups=channels)
            got = np.array(y.astype(mx.float32))[:, at, np.arange(channels)]
            window = x[:, at[:, None] + np.arange(K), np.arange(channels)[:, None]]  # [B, channels, K]
            p = window * w[None]
            values = sorted(set(got.ravel().tolist()))
            line = ", ".join(f"{n} {np.mean(s == got):.4f}" for n, s in candidates(p).items())
            print(f"L={length} B={batch}: values seen {values[:6]}; match: {line}")


if __name__ == "__main__":
    main()
