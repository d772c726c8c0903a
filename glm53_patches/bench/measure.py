"""Arms (patch sets switched in-process), interleaved timing, checks and probes."""

import hashlib
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter

import mlx.core as mx
import numpy as np

from ..exactness import host_bits


VIEWS = {"Reshape", "Squeeze", "ExpandDims", "Broadcast", "BroadcastAxes", "Slice", "Transpose",
         "AsStrided", "Flatten", "Unflatten", "StopGradient", "View", "Split"}


class Progress:
    def __init__(self, quiet=False):
        self.start = time.monotonic()
        self.quiet = quiet

    def elapsed(self):
        return time.monotonic() - self.start

    def __call__(self, message):
        if not self.quiet:
            print(f"[bench {self.elapsed():7.1f}s] {message}", file=sys.stderr, flush=True)


# -- arms ------------------------------------------------------------------------------


def discover_patches():
    """Installed patches; patch packages of this checkout are registered when no
    entry point provides them (a run from a source tree, e.g. on the GPU machine)."""
    import importlib
    import pkgutil

    from .. import patches as package
    from .. import registry

    available, errors = registry.available(), []
    for info in pkgutil.iter_modules(package.__path__):
        try:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            hook = getattr(module, "glm53_patches", None)
            if hook is not None and any(p.name not in available for p in hook()):
                registry.register_plugin(module)
                available = registry.available()
        except Exception as exc:  # noqa: BLE001 - a broken patch package must not stop the bench
            errors.append(f"patch package {info.name!r} could not be loaded: {exc!r}")
    return available, errors


class Arms:
    """``stock,compiled_kda_decode,a+b,all``: each arm a set of patch names."""

    def __init__(self, spec, progress, force=False):
        from .. import registry

        self.force = force
        self._logger = logging.getLogger("glm53_patches")
        self._log_level = self._logger.level
        self._logger.setLevel(logging.WARNING)  # no "applied"/"reverted" line at every switch
        self.progress = progress
        self.patches, self.notes = discover_patches()
        self.sets, self.current = {}, None
        for label in [s.strip() for s in spec.split(",") if s.strip()]:
            if label == "stock":
                names = []
            elif label == "each":
                for name in self.patches:
                    self._add(name, [name])
                continue
            else:  # a+b; "all" is what GLM53_PATCHES=all turns on here
                names = []
                for part in label.split("+"):
                    names += [n for n, p in self.patches.items() if registry.covered_by_all(p)] if part == "all" else [part]
            self._add(label, list(dict.fromkeys(names)))
        if "stock" not in self.sets:
            self.sets = {"stock": [], **self.sets}
        self.state = {label: {"patches": names, "numerics": self.numerics(label), "applied": None}
                      for label, names in self.sets.items()}
        self.counters = {label: Counter() for label in self.sets}
        self._before = None
        registry.revert()

    def _add(self, label, names):
        for other, existing in self.sets.items():
            if sorted(existing) == sorted(names):
                self.notes.append(f"arm {label!r} is the same patch set as {other!r}: not run twice")
                return
        self.sets[label] = names

    @property
    def labels(self):
        return list(self.sets)

    def numerics(self, label):
        names = self.sets[label]
        if any(n not in self.patches for n in names):
            return "unknown"
        return "exact" if all(self.patches[n].numerics == "exact" for n in names) else "changing"

    def _hits(self):
        return {n: p.stats.snapshot() for n, p in self.patches.items()}

    def activate(self, label):
        import glm53_patches

        if label == self.current:
            return
        self.release()
        names = self.sets[label]
        if names:
            report = glm53_patches.enable(names, force=names if self.force else ())
            forced = [n for n in names if report.get(n, {}).get("forced")]
            if forced:
                self.state[label]["forced_despite_drift"] = forced
            missing = {n: report.get(n, {}).get("reason") or report.get(n, {}).get("state", "unknown")
                       for n in names if not report.get(n, {}).get("applied")}
            self.state[label]["applied"] = not missing
            if missing:
                self.state[label]["not_applied"] = missing
        else:
            self.state[label]["applied"] = True
        self.current, self._before = label, self._hits()

    def release(self):
        import glm53_patches

        if self.current is None:
            return
        after = self._hits()
        for name in self.sets[self.current]:
            if name in after:
                for key in ("hits", "fallbacks"):
                    for what, n in after[name][key].items():
                        d = n - self._before[name][key].get(what, 0)
                        if d:
                            self.counters[self.current][f"{name}.{key}.{what}"] += d
        glm53_patches.disable()
        self.current = None

    def close(self):
        self.release()
        self._logger.setLevel(self._log_level)


# -- timing ----------------------------------------------------------------------------


def _digest(arrays):
    h = hashlib.sha1()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()[:16]


class Workload:
    """make() -> state; step(state, i) -> evaluated arrays; final(state) -> arrays; token(outs).

    With ``build(state, i)`` (the step's lazy graph, not evaluated) the step is build then
    ``mx.eval``, and the time spent building is reported. ``pipelined(state, i)`` builds
    the step as mlx-vlm's decode loop does; it is timed in that loop (``Runner.pipeline``).
    """

    def __init__(self, name, make, step=None, final=lambda s: [], token=None, unit="ms", per=1,
                 build=None, pipelined=None):
        self.name, self.make, self.final = name, make, final
        self.build, self.pipelined = build, pipelined
        self.step = step or (lambda state, i: _evaluated(build(state, i)))
        self.token, self.unit, self.per = token, unit, per


def _evaluated(arrays):
    mx.eval(arrays)
    return arrays


def summarize(times_by_round):
    pooled = [t for r in times_by_round for t in r]
    medians = [statistics.median(r) for r in times_by_round if r]
    return {"median": statistics.median(pooled), "min": min(medians), "max": max(medians),
            "round_medians": medians, "samples": len(pooled)}


class Runner:
    def __init__(self, arms, progress, deadline):
        self.arms, self.progress, self.deadline = arms, progress, deadline
        self._generation_stream = None

    def past_deadline(self):
        return time.monotonic() > self.deadline

    def check(self, workload, steps):
        """Untimed pass per arm from the same start (also the warm-up): outputs, tokens
        and final state compared with stock, bit for bit."""
        records = {}
        for label in self.arms.labels:
            self.arms.activate(label)
            start = time.perf_counter()
            state = workload.make()
            outs, tokens = [], []
            for i in range(steps):
                arrays = workload.step(state, i)
                outs.append([host_bits(a) for a in arrays])
                if workload.token:
                    tokens.append(workload.token(arrays))
            records[label] = {"outs": outs, "tokens": tokens, "final": [host_bits(a) for a in workload.final(state)],
                              "seconds": time.perf_counter() - start}  # a cold first pass: its compile stall
        self.arms.release()
        stock = records["stock"]
        verdicts = {}
        for label, rec in records.items():
            if label == "stock":
                continue
            same = all(len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
                       for a, b in zip(rec["outs"], stock["outs"]))
            final = all(np.array_equal(x, y) for x, y in zip(rec["final"], stock["final"]))
            diff = max((float(np.max(np.abs(_f32(x) - _f32(y)))) for a, b in zip(rec["outs"], stock["outs"])
                        for x, y in zip(a, b) if x.size and x.dtype.kind in "fu" and x.shape == y.shape), default=0.0)
            verdicts[label] = {"compared_with": "stock", "steps": steps, "outputs_bitwise": same,
                               "final_state_bitwise": final, "max_abs_diff": diff,
                               "tokens": rec["tokens"], "stock_tokens": stock["tokens"],
                               "tokens_match": rec["tokens"] == stock["tokens"] if workload.token else None,
                               "seconds": rec["seconds"], "stock_seconds": stock["seconds"],
                               "digest": _digest([x for o in rec["outs"] for x in o]),
                               "stock_digest": _digest([x for o in stock["outs"] for x in o])}
        return verdicts

    def timed(self, workload, rounds, warmup, steps, time_stock=True, pipelined_steps=0):
        """Interleaved rounds (A B, B A, ...), each from a fresh state. Without
        ``time_stock``, stock is left out and ratios are against the first arm. With
        ``pipelined_steps`` and a workload that has ``pipelined``, each arm's turn in a
        round also runs mlx-vlm's decode loop from a fresh state (``pipeline``)."""
        labels = [l for l in self.arms.labels if time_stock or l != "stock"]
        pipelined = bool(pipelined_steps and workload.pipelined)
        times, builds = {label: [] for label in labels}, {label: [] for label in labels}
        peaks = {label: 0 for label in labels}
        tokens = {label: [] for label in labels}
        loops = {label: [] for label in labels}
        for r in range(rounds):
            for label in (labels if r % 2 == 0 else labels[::-1]):
                self.arms.activate(label)
                state = workload.make()
                seen = []
                for i in range(warmup):
                    arrays = workload.step(state, i)
                    if workload.token:
                        seen.append(workload.token(arrays))
                mx.reset_peak_memory()
                run, built = [], []
                for i in range(warmup, warmup + steps):
                    t0 = time.perf_counter()
                    if workload.build:  # the graph first, then its evaluation: the same step, split
                        arrays = workload.build(state, i)
                        built.append((time.perf_counter() - t0) * 1e3 / workload.per)
                        mx.eval(arrays)
                    else:
                        arrays = workload.step(state, i)
                    run.append((time.perf_counter() - t0) * 1e3 / workload.per)
                    if workload.token:
                        seen.append(workload.token(arrays))
                peaks[label] = max(peaks[label], mx.get_peak_memory())
                times[label].append(run)
                builds[label].append(built)
                tokens[label].append(seen)
                line = f"{statistics.median(run):9.3f} {workload.unit}"
                del state
                if pipelined:
                    loops[label].append(self.pipeline(workload, workload.make(), warmup, pipelined_steps))
                    line += f", pipelined {statistics.median(loops[label][-1]['ms_per_token']):9.3f}"
                self.progress(f"{workload.name} | {label:>22} | round {r + 1}/{rounds} | {line}")
            if self.past_deadline() and r + 1 < rounds:
                self.progress(f"{workload.name}: time budget spent, stopping after {r + 1} rounds")
                break
        self.arms.release()
        out = {}
        base_label = labels[0]  # stock, when timed
        base = summarize(times[base_label])
        ratio = f"ratio_vs_{'stock' if time_stock else 'first_arm'}"
        for label in labels:
            entry = summarize(times[label])
            entry[ratio] = base["median"] / entry["median"]
            entry["ratio_rounds"] = [s / a for s, a in zip(base["round_medians"], entry["round_medians"])]
            entry["peak_memory"] = peaks[label]
            if workload.build:
                entry["build_ms"] = summarize(builds[label])
            if workload.token and time_stock:
                entry["timed_tokens_match_stock"] = all(t == tokens["stock"][0] for t in tokens[label])
            out[label] = entry
        if pipelined:
            base = summarize([loop["ms_per_token"] for loop in loops[base_label]])
            for label in labels:
                entry = out[label]["pipelined"] = _pipelined_summary(loops[label], base, out[label], ratio)
                if time_stock:
                    entry["tokens_match_stock"] = all(l["tokens"] == loops["stock"][0]["tokens"] for l in loops[label])
                # the same greedy tokens as this arm's synchronous steps, as far as both ran
                entry["tokens_match_synchronous"] = all(
                    l["tokens"][:len(t)] == t[:len(l["tokens"])] for l, t in zip(loops[label], tokens[label]))
        return {"unit": workload.unit, "rounds": len(times[base_label]), "warmup": warmup, "steps": steps,
                "ratio_base": base_label, "arms": out, **({"pipelined_steps": pipelined_steps} if pipelined else {})}

    def pipeline(self, workload, state, warmup, steps):
        """mlx-vlm 0.7.10's decode loop (generate/ar.py ``generate_step``; the server's
        ``GenerationBatch._step`` is the same pattern): step n+1 is built on step n's
        lazy token and ``mx.async_eval``'d before step n's token is read with ``.item()``.
        Per timed token: the ms since the previous token arrived, and the thread's ms
        building step n+1's graph, inside ``async_eval`` and waiting in ``.item()``."""
        stream = self._stream()
        record = {"ms_per_token": [], "build_ms": [], "async_eval_ms": [], "wait_ms": [], "tokens": []}

        def launch(i):
            t0 = time.perf_counter()
            with mx.stream(stream):
                arrays = workload.pipelined(state, i)
            t1 = time.perf_counter()
            mx.async_eval(*arrays)
            return arrays, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

        current = launch(0)[0]
        last = time.perf_counter()
        for n in range(warmup + steps):
            ahead, build_ms, async_ms = launch(n + 1)
            if (n + 1) % CACHE_EVAL_INTERVAL == 0:
                mx.eval(workload.final(state))
            t0 = time.perf_counter()
            token = workload.token(current)
            now = time.perf_counter()
            if n % 256 == 0:
                mx.clear_cache()
            record["tokens"].append(token)
            if n >= warmup:
                for key, value in (("ms_per_token", now - last), ("wait_ms", now - t0)):
                    record[key].append(value * 1e3)
                record["build_ms"].append(build_ms)
                record["async_eval_ms"].append(async_ms)
            last, current = now, ahead
        mx.eval(current)  # the step built ahead, finished before anything else is timed
        return record

    def _stream(self):
        # mlx-vlm builds every step under its generation stream (generate/common.py)
        if self._generation_stream is None:
            make = getattr(mx, "new_thread_local_stream", mx.new_stream)  # mlx-vlm 0.7.10 calls the newer one
            self._generation_stream = make(mx.default_device())
        return self._generation_stream


CACHE_EVAL_INTERVAL = 50  # ar.py's DEFAULT_CACHE_EVAL_INTERVAL: the caches are evaluated every 50 tokens


def _pipelined_summary(loops, base, synchronous, ratio):
    entry = {key: summarize([loop[key] for loop in loops])
             for key in ("ms_per_token", "build_ms", "async_eval_ms", "wait_ms")}
    ms = entry["ms_per_token"]
    entry.update(tokens_per_s=1e3 / ms["median"], tokens_per_s_min=1e3 / ms["max"], tokens_per_s_max=1e3 / ms["min"],
                 ratio_rounds=[b / a for b, a in zip(base["round_medians"], ms["round_medians"])],
                 speedup_vs_synchronous=synchronous["median"] / ms["median"])
    entry[ratio] = base["median"] / ms["median"]
    return entry


def _f32(x):
    if x.dtype == np.uint16:  # bf16 bits -> float32
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float64)


# -- graph primitives --------------------------------------------------------------------


def count_primitives(outputs):
    """Primitive nodes of the lazy graph behind ``outputs`` (from mx.export_to_dot)."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *outputs)
        with open(path) as f:
            labels = re.findall(r'\[label ="([^"]+)", shape=rectangle\]', f.read())
    finally:
        os.unlink(path)
    kinds = Counter(labels)
    return {"total": len(labels), "not_views": sum(n for k, n in kinds.items() if k not in VIEWS),
            "by_primitive": dict(kinds.most_common())}


# -- probes ------------------------------------------------------------------------------


def _median_time(fn, reps, warm=2):
    for _ in range(warm):
        mx.eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bandwidth(on_gpu, config, dtype, small=False):
    """A large copy (bytes read + written) and an 8-bit quantized matvec (bytes read)."""
    size = (2 << 30) if on_gpu else (64 << 20) if small else (256 << 20)
    x = mx.random.randint(0, 256, (size // 4096, 4096), dtype=mx.uint8).view(mx.uint32)
    mx.eval(x)
    copy_s = _median_time(lambda: x + 1, 10)
    rows = config.vocab_size if on_gpu else 8192 if small else 32768
    rows, cols = max(rows, 8192), max(config.hidden_size, 4096)
    w = mx.random.randint(0, 256, (rows, cols), dtype=mx.uint8).view(mx.uint32)
    scales = mx.random.uniform(0.01, 0.02, (rows, cols // 64)).astype(dtype)
    v = mx.random.normal((1, cols)).astype(dtype)
    mx.eval(w, scales, v)
    mv_s = _median_time(lambda: mx.quantized_matmul(v, w, scales, scales, transpose=True, group_size=64, bits=8), 20)
    mv_bytes = w.nbytes + 2 * scales.nbytes
    return {"copy_bytes": 2 * size, "copy_GBps": 2 * size / copy_s / 1e9,
            "matvec_shape": [rows, cols], "matvec_bits": 8, "matvec_bytes": mv_bytes,
            "matvec_GBps": mv_bytes / mv_s / 1e9}
