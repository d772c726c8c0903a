"""Device check for the KDA prefill CUDA kernel: accuracy and timing on a GPU.

    python3 -m glm53_patches.patches.kda_prefill_kernel.checks.device_check --out FILE.json

The recurrence alone at GLM-5.3-Flash widths (64 heads, Dk = Dv = 128, bf16
q/k/v, float32 state, KDA's safe gate with lower bound -5), three arms:

* stock: mlx-vlm's ``gated_delta_update`` called as the mixer calls it (off
  Metal: ``gated_delta_ops``, the per-token loop of compiled steps);
* chunked: this patch's ``chunked_gated_delta`` (at each ``--chunks`` size);
* kernel: ``cuda.kernel_gated_delta`` (one launch; CUDA only, else skipped).

Cases: B=1 at T = 512, 2048, 4096 (fresh state); B=2, T=1024, row 0
left-padded by 100 (masked, inputs zeroed there as the mixer does); B=1,
T=1024 resumed from a random initial state. For each: max |y - ref| (valid
positions) and max |state - ref| against a float64 numpy recurrence on the
CPU (threads over head groups), whether masked outputs are 0, and timing:
rounds of stock, chunked, kernel (order alternated), median ms and the
min-max over rounds. Stock is timed only up to ``--stock-max-tokens`` (its
per-token loop is slow at 4096; the JSON says which were skipped).

Needs only mlx, mlx-vlm's model files and this package (bare-package import
where mlx_vlm's __init__ cannot load). Prints progress, one table, and the
JSON (also written to --out, or $OUT/kda_prefill_device_check.json). Exit 1
when the kernel's error exceeds the bounds below or an arm raised.
"""

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

LB = -5.0
# Pass bounds for the kernel (float32 accumulation, per-token order like
# stock): state within 2x stock's error + 1e-5; y within bf16 output rounding.
STATE_SLACK = 1e-5
STOCK_MAX_S = 8.0  # stock's first call slower than this: not timed (keeps the run under ~150 s)


def say(*parts):
    print(*parts, flush=True)


def _import():
    from glm53_patches import upstream_import

    upstream_import.import_language()
    return upstream_import.bare_reason or "mlx_vlm imported normally"


def make_inputs(mx, batch, length, heads, dim, seed, padding=None, resumed=False, dtype="bfloat16"):
    """Mixer-like inputs: q, k rms-normed and scaled (Dk^-1, Dk^-0.5), gate parameters as bench.py."""
    keys = mx.random.split(mx.random.key(seed), 9)
    shape = (batch, length, heads, dim)
    q = dim**-1.0 * mx.fast.rms_norm(mx.random.normal(shape, key=keys[0]), None, 1e-6)
    k = dim**-0.5 * mx.fast.rms_norm(mx.random.normal(shape, key=keys[1]), None, 1e-6)
    v = mx.random.normal(shape, key=keys[2])
    a = mx.random.normal(shape, key=keys[3])
    b = mx.random.normal(shape[:3], key=keys[4])
    A_log = mx.random.uniform(0.0, 1.4, (heads, 1), key=keys[5])
    dt_bias = mx.random.uniform(-4.0, -1.0, (heads, dim), key=keys[6])
    state = 0.5 * mx.random.normal((batch, heads, dim, dim), key=keys[7]) if resumed else None
    mask = None
    if padding is not None:
        mask = mx.arange(length)[None] >= mx.array(padding)[:, None]
        q, k, v = (mx.where(mask[:, :, None, None], x, 0) for x in (q, k, v))  # as the mixer zeroes x
    q, k, v, a, b = (x.astype(getattr(mx, dtype)) for x in (q, k, v, a, b))
    arrays = [q, k, v, a, b, A_log, dt_bias] + [x for x in (state, mask) if x is not None]
    mx.eval(*arrays)
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, mask=mask)


def _f64(mx, x):
    return np.array(x.astype(mx.float32)).astype(np.float64)


def reference(mx, x, workers=8):
    """float64 recurrence, token by token; heads split over threads (numpy releases the GIL)."""
    q, k, v, a, A_log, dt_bias = (_f64(mx, x[n]) for n in ("q", "k", "v", "a", "A_log", "dt_bias"))
    beta = _f64(mx, mx.sigmoid(x["b"]))  # stock's sigmoid in the input dtype: shared rounding
    g = np.exp(LB / (1.0 + np.exp(-np.exp(A_log) * (a + dt_bias))))
    B, T, H, D = q.shape
    S0 = np.zeros((B, H, v.shape[-1], D)) if x["state"] is None else _f64(mx, x["state"])
    keep = np.ones((B, T), bool) if x["mask"] is None else np.array(x["mask"])
    y = np.zeros(v.shape)
    S_out = np.empty_like(S0)

    def run(heads):
        S = S0[:, heads].copy()
        for t in range(T):
            new = S * g[:, t, heads][:, :, None, :]
            kt = k[:, t, heads]
            delta = beta[:, t, heads][..., None] * (v[:, t, heads] - (new @ kt[..., None])[..., 0])
            new += delta[..., None] * kt[:, :, None, :]
            y[:, t, heads] = np.where(keep[:, t, None, None], (new @ q[:, t, heads][..., None])[..., 0], 0.0)
            S = np.where(keep[:, t, None, None, None], new, S)
        S_out[:, heads] = S

    groups = [slice(i, min(H, i + max(1, H // workers))) for i in range(0, H, max(1, H // workers))]
    with ThreadPoolExecutor(len(groups)) as pool:
        list(pool.map(run, groups))
    return y, S_out, keep


def arms_for(mx, x, chunks, with_kernel):
    from mlx_vlm.models import gated_delta

    from glm53_patches.patches.kda_prefill_kernel import chunked, cuda

    q, k, v, a, b, A_log, dt_bias = (x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias"))
    state, mask = x["state"], x["mask"]

    def stock():
        return gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=state, mask=mask, lower_bound=LB)

    arms = {"stock": stock}
    for chunk in chunks:

        def run(chunk=chunk):
            return chunked.chunked_gated_delta(
                q, k, v, chunked.log_gate(A_log, a, dt_bias, LB), mx.sigmoid(b), state, mask,
                chunk=chunk, sub=chunked.sub_block(chunk, LB),
            )

        arms[f"chunked{chunk}"] = run
    if with_kernel:

        def kernel(verbose=False):
            log_g, beta = chunked.log_gate(A_log, a, dt_bias, LB), mx.sigmoid(b)
            out = cuda.kernel_gated_delta(q, k, v, log_g, beta, state, mask, verbose=verbose)
            if out is None:
                raise RuntimeError(f"kernel declined: {cuda.unsupported(q, k, v, log_g, beta, state, mask)}")
            return out

        arms["kernel"] = kernel
    return arms


def check_case(mx, name, x, chunks, with_kernel, rounds, time_stock, workers):
    say(f"[{name}] float64 reference ...")
    start = time.perf_counter()
    y_ref, s_ref, keep = reference(mx, x, workers)
    result = {"reference_s": round(time.perf_counter() - start, 1), "max_abs_y_ref": float(np.abs(y_ref).max()),
              "max_abs_state_ref": float(np.abs(s_ref).max()), "errors": {}, "timing_ms": {}, "failures": {}}
    say(f"[{name}] reference {result['reference_s']} s")
    arms = arms_for(mx, x, chunks, with_kernel)
    outputs = {}
    for arm, fn in arms.items():  # first call: compiles, and the outputs for accuracy
        try:
            start = time.perf_counter()
            y, s = fn()[:2]
            mx.eval(y, s)
            first = time.perf_counter() - start
            y64, s64 = _f64(mx, y), _f64(mx, s)
            result["errors"][arm] = {
                "y": float(np.abs(np.where(keep[:, :, None, None], y64 - y_ref, 0.0)).max()),
                "state": float(np.abs(s64 - s_ref).max()),
                "masked_y_zero": bool(np.all(y64[~keep] == 0)),
                "finite": bool(np.isfinite(y64).all() and np.isfinite(s64).all()),
                "y_dtype": str(y.dtype), "state_dtype": str(s.dtype), "first_call_s": round(first, 3),
            }
            outputs[arm] = True
            say(f"[{name}] {arm}: y err {result['errors'][arm]['y']:.2e}, state err "
                f"{result['errors'][arm]['state']:.2e}, first call {first:.2f} s")
        except Exception as exc:  # report, do not hide
            result["failures"][arm] = f"{type(exc).__name__}: {exc}"
            say(f"[{name}] {arm} FAILED: {result['failures'][arm]}")
            if arm == "kernel":  # show MLX's generated source once, for diagnosis
                try:
                    arms["kernel"](verbose=True)
                except Exception:  # noqa: BLE001 - already reported
                    pass
    slow_stock = result["errors"].get("stock", {}).get("first_call_s", 0.0) > STOCK_MAX_S
    timed = [a for a in arms if a in outputs and (a != "stock" or (time_stock and not slow_stock))]
    if not time_stock:
        result["timing_note"] = "stock not timed at this length (per-token loop; see --stock-max-tokens)"
    elif slow_stock:
        result["timing_note"] = f"stock not timed: its first call took over {STOCK_MAX_S} s"
    samples = {a: [] for a in timed}
    for r in range(rounds):
        for arm in timed if r % 2 == 0 else timed[::-1]:
            start = time.perf_counter()
            mx.eval(*arms[arm]()[:2])
            samples[arm].append(1e3 * (time.perf_counter() - start))
        say(f"[{name}] round {r + 1}/{rounds}: " + ", ".join(f"{a} {samples[a][-1]:.1f} ms" for a in timed))
    for arm in timed:
        result["timing_ms"][arm] = {"median": round(statistics.median(samples[arm]), 3),
                                    "min": round(min(samples[arm]), 3), "max": round(max(samples[arm]), 3),
                                    "rounds": [round(t, 3) for t in samples[arm]]}
    if "kernel" in result["timing_ms"]:
        kernel_ms = result["timing_ms"]["kernel"]["median"]
        result["median_over_kernel_median"] = {
            a: round(t["median"] / kernel_ms, 2) for a, t in result["timing_ms"].items()
        }
    return result


def verdict(case):
    """Kernel accuracy bounds: the state within 2x stock's error + 1e-5, y within bf16 rounding of |y|."""
    errs = case["errors"]
    if "kernel" not in errs:
        return "kernel " + ("failed" if "kernel" in case["failures"] else "not run")
    kern = errs["kernel"]
    stock_state = errs.get("stock", {}).get("state", 0.0)
    ok = (kern["finite"] and kern["masked_y_zero"] and kern["state"] <= 2 * stock_state + STATE_SLACK
          and kern["y"] <= case["max_abs_y_ref"] * 2**-7 + 1e-6)
    return "ok" if ok else "kernel error above bounds"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON summary here")
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--heads", type=int, default=64, help="TextConfig linear_num_heads")
    parser.add_argument("--dim", type=int, default=128, help="TextConfig linear_head_dim")
    parser.add_argument("--chunks", default="16,64", help="chunked-path chunk sizes to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stock-max-tokens", type=int, default=2048, help="time stock only up to this T")
    parser.add_argument("--special-length", type=int, default=1024, help="T of the masked and resumed cases")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="reference threads")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    imported = _import()
    import mlx.core as mx

    from glm53_patches.patches.kda_prefill_kernel import cuda

    with_kernel = cuda.cuda_available()
    chunks = [int(c) for c in args.chunks.split(",") if c]
    summary = {
        "device": str(mx.default_device()), "cuda": with_kernel, "mlx": getattr(mx, "__version__", "?"),
        "imports": imported, "heads": args.heads, "dim": args.dim, "dtype": "bfloat16 q/k/v, float32 state",
        "gate_lower_bound": LB, "rounds": args.rounds, "cases": {},
    }
    say(f"device {summary['device']}, mlx {summary['mlx']}, CUDA kernel {'on' if with_kernel else 'OFF (not CUDA)'}")
    special = args.special_length
    pad = min(100, special - 1)
    cases = [(f"T{T}", dict(batch=1, length=T)) for T in (int(t) for t in args.lengths.split(",") if t)]
    cases += [
        (f"B2_T{special}_leftpad{pad}", dict(batch=2, length=special, padding=[pad, 0])),
        (f"T{special}_resumed", dict(batch=1, length=special, resumed=True)),
    ]
    failed = False
    for seed, (name, spec) in enumerate(cases):
        x = make_inputs(mx, heads=args.heads, dim=args.dim, seed=seed, **spec)
        case = check_case(mx, name, x, chunks, with_kernel, args.rounds, spec["length"] <= args.stock_max_tokens,
                          args.workers)
        case["shape"] = {k: v for k, v in spec.items()}
        case["verdict"] = verdict(case)
        failed |= bool(case["failures"]) or (with_kernel and case["verdict"] != "ok")
        summary["cases"][name] = case
        say(f"[{name}] verdict: {case['verdict']} ({time.perf_counter() - started:.0f} s elapsed)")
    summary["total_s"] = round(time.perf_counter() - started, 1)

    arms = ["stock"] + [f"chunked{c}" for c in chunks] + ["kernel"]
    say("")
    say(f"{'case':<22} {'arm':<10} {'y err':>9} {'state err':>9} {'median ms':>10} {'min-max ms':>19}")
    for name, case in summary["cases"].items():
        for arm in arms:
            err = case["errors"].get(arm)
            t = case["timing_ms"].get(arm)
            if err is None and t is None:
                continue
            errs = f"{err['y']:>9.2e} {err['state']:>9.2e}" if err else f"{'-':>9} {'-':>9}"
            times = f"{t['median']:>10.2f} {t['min']:>9.2f}-{t['max']:<9.2f}" if t else f"{'-':>10} {'-':>19}"
            say(f"{name:<22} {arm:<10} {errs} {times}")
        say(f"{'':<22} verdict: {case['verdict']}" + (f"; failures: {case['failures']}" if case["failures"] else ""))
    text = json.dumps(summary, indent=1, default=str)
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], "kda_prefill_device_check.json")
    if out:
        with open(out, "w") as handle:
            handle.write(text)
        say(f"wrote {out}")
    say(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
