"""Does MLX's CUDA gather_mm return NaN at many experts? (s24: stock SwitchGLU gave 29M NaNs at 288
experts, bf16, 2048 tokens, top-8; none at 64.) One projection [E, 2048, 4096], sorted routes, against
a per-expert matmul reference, over expert counts, dtypes and sorted/unsorted.

    python benchmarks/h200/probe_gather_mm_nan.py [--out F.json]
"""

import argparse
import json

import mlx.core as mx

TOKENS, TOP_K, IN, OUT = 2048, 8, 4096, 2048


def reference(x, w, idx_sorted):
    """Each expert's contiguous block of sorted rows times its weight, in float32."""
    ends = mx.cumsum(mx.zeros((w.shape[0],), dtype=mx.int32).at[idx_sorted.astype(mx.int32)].add(1)).tolist()
    starts = [0] + ends[:-1]
    return mx.concatenate([x[s:e].astype(mx.float32) @ w[i].astype(mx.float32).T
                           for i, (s, e) in enumerate(zip(starts, ends)) if e > s])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--experts", default="64,128,255,256,257,288")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--tokens", type=int, default=TOKENS)
    a = p.parse_args()
    rows = []
    for dtype in [getattr(mx, d) for d in a.dtypes.split(",")]:
        for n in [int(v) for v in a.experts.split(",")]:
            mx.random.seed(0)
            w = (mx.random.normal((n, OUT, IN)) * IN ** -0.5).astype(dtype)
            x = mx.random.normal((a.tokens, IN)).astype(dtype)
            idx = mx.argpartition(-mx.random.normal((a.tokens, n)), TOP_K, axis=-1)[..., :TOP_K].reshape(-1).astype(mx.uint32)
            order = mx.argsort(idx)
            idx_s = idx[order]
            xs = x[order // TOP_K][:, None, :]
            wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
            wd = mx.dequantize(wq, scales, biases, group_size=64, bits=4)
            arms = {  # stock's quantized path, and dequantized_experts' gather_mm over the same weights
                "gather_mm sorted": lambda s=True: mx.gather_mm(xs, w.swapaxes(-1, -2), rhs_indices=idx_s, sorted_indices=s),
                "gather_mm unsorted": lambda s=False: mx.gather_mm(xs, w.swapaxes(-1, -2), rhs_indices=idx_s, sorted_indices=s),
                "gather_qmm 4-bit sorted": lambda: mx.gather_qmm(xs, wq, scales, biases, rhs_indices=idx_s, transpose=True,
                                                                 group_size=64, bits=4, sorted_indices=True),
                "gather_mm over dequantized 4-bit sorted": lambda: mx.gather_mm(xs, wd.swapaxes(-1, -2), rhs_indices=idx_s,
                                                                                sorted_indices=True),
            }
            for arm, fn in arms.items():
                got = fn()
                got = got.reshape(-1, OUT).astype(mx.float32)
                wr = wd if "4-bit" in arm else w
                ref = reference(xs[:, 0], wr, idx_s)
                nans = int(mx.isnan(got).sum().item())
                finite = mx.where(mx.isnan(got), 0, got)
                bad_rows = int((mx.isnan(got).any(axis=-1)).sum().item())
                first_bad = int(mx.argmax(mx.isnan(got).any(axis=-1)).item()) if bad_rows else -1
                row = {"dtype": str(dtype), "experts": n, "arm": arm, "nans": nans, "bad_rows": bad_rows,
                       "first_bad_row_expert": int(idx_s[first_bad].item()) if bad_rows else None,
                       "max_abs_diff_finite": float(mx.abs(finite - ref).max().item())}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        open(a.out, "w").write(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
