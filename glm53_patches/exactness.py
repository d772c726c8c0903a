"""Bit-for-bit comparison shared by the patches' ``verify`` checks."""

import sys
import time

import mlx.core as mx
import numpy as np

from .backend import current as backend

_UNSIGNED = {2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def same_bits(a, b) -> bool:
    """Same dtype, shape and bytes (so -0.0 != 0.0 and NaN payloads count): MLX or NumPy arrays."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    unsigned = _UNSIGNED.get(a.dtype.size)
    if unsigned is None:
        return bool(mx.array_equal(a, b).item())
    return bool(mx.array_equal(a.view(unsigned), b.view(unsigned)).item())


def cache_fields(cache, path="cache"):
    """``(path, value)`` of every array and plain field of a list of caches, recursively, in a fixed
    order: what a decode or a rollback leaves behind, to compare bit for bit."""
    from mlx_vlm.models.cache import CacheList

    if isinstance(cache, (list, tuple)):
        return [item for i, c in enumerate(cache) for item in cache_fields(c, f"{path}[{i}]")]
    if isinstance(cache, CacheList):
        return cache_fields(list(cache.caches), f"{path}.caches")
    if isinstance(cache, mx.array) or cache is None or isinstance(cache, (bool, int, float, str)):
        return [(path, cache)]
    if isinstance(cache, dict):
        return [item for k, v in sorted(cache.items()) for item in cache_fields(v, f"{path}[{k!r}]")]
    return [item for k, v in sorted(vars(cache).items()) for item in cache_fields(v, f"{path}.{k}")]


def host_bits(x) -> np.ndarray:
    """The array's bits as a NumPy array (bf16 and fp16 as uint16), e.g. to hash them."""
    if x.size == 0:  # np.array() of an empty MLX CUDA array segfaults (MLX 0.32.4)
        return np.zeros(x.shape, dtype=np.uint8)
    if x.dtype in (mx.bfloat16, mx.float16):
        x = x.view(mx.uint16)
    return np.array(x)


def abs_diff(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())


class Tally:
    """Counts compared cases, mismatches and the largest difference seen, and keeps one record per case.

    A record is ``{"case", "result", "max_abs_diff"}`` with result ``exact``,
    ``differs``, ``inconclusive`` (nothing can be concluded, e.g. stock differs
    from itself) or ``failed`` (the case raised; ``error`` says how): what
    ``glm53-patches verify --report`` writes for each case.
    """

    def __init__(self):
        self.mismatches = []
        self.max_abs_diff = 0.0
        self.notes = []
        self.records = []
        self._start = time.perf_counter()

    def _record(self, record):
        """Keeps a case's record and says it on stderr as it ends: a verify runs for minutes, and one
        that is killed (a time limit, a hung launch) still shows how far it got."""
        self.records.append(record)
        print(f"  {time.perf_counter() - self._start:7.1f} s  {record['result']:12} {record['case']}", file=sys.stderr,
              flush=True)

    @property
    def cases(self):
        """Cases so far: every kind counts (exact, differs, inconclusive, failed)."""
        return len(self.records)

    def compare(self, name, expected, actual):
        mx.eval(expected, actual)
        differing, worst = [], 0.0
        for i, (a, b) in enumerate(zip(expected, actual)):
            if not same_bits(a, b):
                differing.append(i)
                worst = max(worst, abs_diff(a, b))
        bad = []
        if differing:
            bad.append(
                f"{len(differing)} of {len(expected)} outputs differ (first: output {differing[0]}; max |diff| {worst:.3g})"
            )
        if len(expected) != len(actual):
            bad.append(f"{len(expected)} outputs expected, {len(actual)} produced")
        return self.add(name, not bad, worst, "; ".join(bad))

    def against_stock(self, name, expected, again, actual):
        """One op case: stock's result (``expected``, and ``again`` from a second run: inconclusive where
        stock differs from itself) against the patch's, bit for bit."""
        mx.eval(expected, again, actual)
        if not same_bits(expected, again):
            return self.inconclusive(name, "stock differs from itself")
        exact = same_bits(expected, actual)
        return self.add(name, exact, 0.0 if exact else abs_diff(expected, actual))

    def add(self, name, exact, max_abs_diff=0.0, why=""):
        """A case the check compared itself: ``exact`` or not (``why`` says where it differs)."""
        self.max_abs_diff = max(self.max_abs_diff, max_abs_diff)
        self._record({"case": name, "result": "exact" if exact else "differs", "max_abs_diff": max_abs_diff,
                      **({"where": why} if why else {})})
        if not exact:
            self.mismatches.append(f"{name}: {why or 'differs'}")
        return exact

    def inconclusive(self, name, why):
        """A case that proves nothing either way (it counts as a case, not as a pass)."""
        self._record({"case": name, "result": "inconclusive", "why": why})
        self.notes.append(f"{name} inconclusive: {why}")

    def failed(self, name, exc):
        """A case that raised: the patch is not verified."""
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        self._record({"case": name, "result": "failed", "error": error})
        self.mismatches.append(f"{name}: raised {error}")

    def result(self, seconds, detail=""):
        """The verify result; ``detail`` replaces the default summary of cases, notes and mismatches."""
        if not detail:
            detail = self._summary(seconds)
        compared = sum(r["result"] in ("exact", "differs") for r in self.records)
        return verify_result(not self.mismatches and compared > 0, self.max_abs_diff, self.cases, detail,
                             self.records)

    def _summary(self, seconds):
        detail = f"{self.cases} cases on {backend()} in {seconds:.1f} s"
        if self.notes:
            detail += "; " + "; ".join(self.notes)
        if self.mismatches:
            shown = self.mismatches[:8]
            more = len(self.mismatches) - len(shown)
            detail += "; MISMATCH: " + " | ".join(shown) + (f" | and {more} more" if more else "")
        return detail


def verify_result(exact, max_abs_diff, cases, detail, case_results=()):
    """What a patch's ``verify`` returns, and ``glm53-patches verify`` records."""
    return {"exact": bool(exact), "max_abs_diff": max_abs_diff, "cases": cases, "detail": detail,
            "case_results": list(case_results)}


def _served_dtype(model, dtype):
    """The model's floats in ``dtype`` as a converted checkpoint stores them.

    mlx-vlm's convert keeps the paths glm5_next's ``cast_predicate`` excludes
    (A_log, dt_bias, the router bias, hyper-connections, the pool compressor)
    in float32; the router's weight stays float32 too (glm5_next computes
    its logits in float32).
    """
    from mlx.utils import tree_flatten

    language = model.language_model
    keep = [(path, value) for path, value in tree_flatten(language.parameters()) if not language.cast_predicate(path)]
    model.set_dtype(dtype)
    language.load_weights(keep, strict=False)
    for layer in language.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight = gate.weight.astype(mx.float32)
    return model


def tiny_prompts():
    """{batch: tokens}: the prompts ``compare_tiny_models`` decodes from, at batch 1 and 2."""
    prompt = mx.array([[(5 * i + 2) % 500 for i in range(40)]])
    return {1: prompt, 2: mx.concatenate([prompt, prompt[:, ::-1]])}


def compare_tiny_models(tally, owner, attr, stock, patched, forcing, steps=16, variants=None, config=None,
                        blocks=False):
    """Greedy decode of the tiny model with ``owner.attr`` = ``stock`` vs ``patched`` (inside ``forcing()``).

    Models (``variants``: (label, quantize bits, served dtype or None)): by
    default fp32; 4-bit on the CPU, bf16 on a GPU (MLX's CUDA quantized
    matmul has no fp32 kernel for the tiny shapes). ``config``: overrides of
    the tiny model's config. Batch 1 and 2; every step's logits bit for bit.
    ``blocks``: also speculative verify blocks (``tiny_model.speculative_outputs``).
    """
    from . import tiny_model

    installed = vars(owner)[attr]
    if variants is None:
        variants = (("fp32", None, None), ("4-bit", 4, None) if backend() == "cpu" else ("bf16", None, mx.bfloat16))
    for label, bits, dtype in variants:
        try:
            model = tiny_model.build_model(seed=1, quantize_bits=bits, **(config or {}))
        except ImportError as exc:  # a bare GPU machine without mlx-vlm's processor dependencies
            tally.notes.append(f"tiny model skipped: {exc}")
            return
        language_model = (_served_dtype(model, dtype) if dtype else model).language_model
        runs = {"": lambda tokens: tiny_model.greedy_logits(language_model, tokens, steps)}
        if blocks:
            runs[" verify blocks"] = lambda tokens: tiny_model.speculative_outputs(language_model, tokens)
        for batch, tokens in tiny_prompts().items():
            for what, run in runs.items():
                results = []
                for fn in (stock, patched):
                    try:
                        setattr(owner, attr, fn)
                        with forcing():
                            results.append(run(tokens))
                    finally:
                        setattr(owner, attr, installed)
                tally.compare(f"tiny model {label} B={batch}{what}", *results)


def verify_gpu_kernel(patch, check_kernel, owner, make_call, switch, attr="__call__", blocks=False):
    """``verify`` of a patch that is one GPU kernel behind ``owner.attr`` and stock elsewhere.

    On a GPU: ``check_kernel(tally, backend)`` (the kernel against stock's
    ops), then the tiny models with the kernel forced on, which must count
    kernel hits. On the CPU: the tiny models only (the wrapper must hand
    every call to stock unchanged). ``blocks``: the tiny models also run
    speculative verify blocks.
    """
    import time

    from . import registry

    start = time.perf_counter()
    here = backend()
    on_gpu = here in ("cuda", "metal")
    tally = Tally()
    before = patch.stats.snapshot()["hits"].get("kernel", 0)
    if on_gpu:
        check_kernel(tally, here)
    stock = registry.upstream(next(iter(patch.targets)))  # stock even while patches are applied
    compare_tiny_models(tally, owner, attr, stock, make_call(stock), lambda: switch.forcing(True), blocks=blocks)
    ran = patch.stats.snapshot()["hits"].get("kernel", 0) - before
    if on_gpu and not ran:  # equal outputs prove nothing if stock ran both times
        tally.mismatches.append("the kernel never ran in the model check")
    if not on_gpu:
        tally.notes.append("no GPU backend: the patch steps aside (stock code)")
    return tally.result(time.perf_counter() - start)


def logit_gate(reference, other, tie=1e-3):
    """Teacher-forced closeness of ``other``'s logits to ``reference``'s (numpy, [..., vocab]), the
    figures a numerics-changing patch's gate asserts: KL(reference || other) mean and max over the
    positions, top-1 agreement, the share of positions whose top two reference logits are more than
    ``tie`` apart ("clear"), and whether the top-1 agrees on every clear position."""
    def log_softmax(v):
        v = v - v.max(-1, keepdims=True)
        return v - np.log(np.exp(v).sum(-1, keepdims=True))

    p, q = log_softmax(np.asarray(reference, np.float64)), log_softmax(np.asarray(other, np.float64))
    kl = (np.exp(p) * (p - q)).sum(-1)
    top = np.sort(reference, -1)
    clear = (top[..., -1] - top[..., -2]) > tie
    same = reference.argmax(-1) == other.argmax(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1": int(same.sum()),
            "positions": int(same.size), "clear": float(clear.mean()), "top1_on_clear": bool(same[clear].all())}
