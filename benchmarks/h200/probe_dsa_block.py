"""Can a DSA layer's verify-block attention run over all positions at once, bit for bit its per-position loop? (issue 16)

At 1 < L <= 8 stock's ``Glm5NextAttention._attend`` (and layer_decode's compiled DSA back, which keeps it)
loops over the block's positions: per position ``embed_q`` (a 6-bit QuantizedMultiLinear, 64 heads),
the attention over that position's selected latent rows, and ``unembed_out``, then one ``concatenate``.
A 4-token block pays that loop in each of 11 DSA layers (s42's counts: 6 Matmul, 3 QuantizedMatmul and
their copies a layer). Here each piece runs both ways at GLM-5.3-Flash's shapes, with the positions
folded into the batch so that every call keeps one query row per head:

- ``embed_q``: ``[B, H, 1, 256]`` per position against ``[B * L, H, 1, 256]`` at once;
- the attention (mlx-vlm's ``scaled_dot_product_attention``, no cache) over ``[B, 1, K, 512]`` rows with
  a boolean mask, per position against ``[B * L, 1, K, 512]`` at once (K = 2,048 + a tail of 3);
- ``unembed_out``: ``[B, H, 1, 512]`` per position against all at once;
- and the three together, as the back would run them.

Prints, per piece and L, whether every output is bit-identical and the us per call of each (median of 6
rounds of 50 calls, arms interleaved A B B A). A piece that is not bit-identical cannot be batched
exactly on this backend.

Usage: python probe_dsa_block.py [--out FILE.json]   (CUDA; on the CPU it runs, but says nothing about CUDA)
"""

import argparse
import json
import statistics

import mlx.core as mx
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.mla import MultiLinear
from probe_rowwise import per_call  # rounds of calls, each round one evaluation

HEADS, NOPE, LATENT, V, ROWS = 64, 256, 512, 256, 2048 + 3
SCALE = NOPE**-0.5


def folded(a):
    """``[B, H, L, D]`` -> ``[B * L, H, 1, D]``: each position its own batch entry."""
    b, h, length, d = a.shape
    return a.transpose(0, 2, 1, 3).reshape(b * length, h, 1, d)


def unfolded(a, batch):
    """The inverse of ``folded``."""
    bl, h, _, d = a.shape
    return a.reshape(batch, bl // batch, h, d).transpose(0, 2, 1, 3)


def attend(query, rows, valid):
    return _lang.scaled_dot_product_attention(query, rows, rows, cache=None, scale=SCALE, mask=valid)


def pieces(embed_q, unembed_out, q, selected, valid):
    """{piece: (per-position fn, all-at-once fn)}, each returning ``[B, H, L, D]``."""
    batch, length = selected.shape[:2]
    rows = selected.reshape(batch * length, 1, *selected.shape[2:])
    mask = valid.reshape(batch * length, 1, 1, -1)
    query = embed_q(q)  # the attention's and unembed's inputs, the same for both arms
    out = attend(folded(query), rows, mask)
    out = unfolded(out, batch)

    def loop(fn, x):
        return mx.concatenate([fn(i, x[:, :, i : i + 1]) for i in range(length)], axis=2)

    def back_loop():  # layer_decode's dsa back, as stock loops it
        return loop(lambda i, qi: unembed_out(attend(embed_q(qi), selected[:, i : i + 1], valid[:, None, i : i + 1])), q)

    def back_once():
        return unfolded(unembed_out(attend(embed_q(folded(q)), rows, mask)), batch)

    return {
        "embed_q": (lambda: loop(lambda i, qi: embed_q(qi), q), lambda: unfolded(embed_q(folded(q)), batch)),
        "attention": (lambda: loop(lambda i, qi: attend(qi, selected[:, i : i + 1], valid[:, None, i : i + 1]), query),
                      lambda: unfolded(attend(folded(query), rows, mask), batch)),
        "unembed_out": (lambda: loop(lambda i, oi: unembed_out(oi), out), lambda: unfolded(unembed_out(folded(out)), batch)),
        "back": (back_loop, back_once),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    dtype = mx.bfloat16
    mx.random.seed(0)
    embed_q = MultiLinear(NOPE, LATENT, HEADS).to_quantized(64, 6)
    unembed_out = MultiLinear(LATENT, V, HEADS).to_quantized(64, 6)
    for m in (embed_q, unembed_out):
        m.set_dtype(dtype)
    results = []
    for length in (2, 4, 8):
        q = mx.random.normal((1, HEADS, length, NOPE)).astype(dtype)
        selected = mx.random.normal((1, length, ROWS, LATENT)).astype(dtype)
        valid = mx.random.uniform(shape=(1, length, ROWS)) < 0.97  # some slots empty, as -1 selections leave
        for piece, (loop, once) in pieces(embed_q, unembed_out, q, selected, valid).items():
            a, b = loop(), once()
            exact = a.shape == b.shape and mx.array_equal(a, b).item()
            times = {"loop": [], "once": []}
            for name, fn in (("loop", loop), ("once", once), ("once", once), ("loop", loop)):
                times[name].extend(per_call(fn))
            us = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
            row = dict(piece=piece, positions=length, exact=exact, loop_us=us["loop"], once_us=us["once"],
                       max_abs_diff=float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()))
            results.append(row)
            print(f"{piece:12s} L={length}  exact {exact}  max diff {row['max_abs_diff']:.3g}  "
                  f"per position {us['loop']:7.1f} us  at once {us['once']:7.1f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
