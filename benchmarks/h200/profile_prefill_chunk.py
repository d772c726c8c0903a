"""Where does one prefill chunk go, inside one KDA and one DSA layer? Times the
last 2,048-token chunk of a CONTEXT-token prompt through each layer, per module
and per glm5_next function, with the patches named in --patches applied.

Every module ``__call__``, every method of a glm5_next class and every function
that glm5_next's language module calls by global name is wrapped: it evaluates
its array arguments, then times itself up to the evaluation of its result.
Times are exclusive (a call's children subtracted), so the rows add up to the
instrumented chunk; the per-call evaluations cost some fusion and launches, so
the uninstrumented chunk is printed beside it. Lazy work nobody evaluates at a
boundary lands in whichever call evaluates it next.

    python benchmarks/h200/profile_prefill_chunk.py [--small] [--context 4096] [--experts 64]
        [--patches dsa_decode,kda_prefill_kernel,latent_prefill,dequantized_experts] [--out F.json]
"""

import argparse
import collections
import functools
import inspect
import json
import time
import types

import mlx.core as mx
import mlx.nn as nn

from glm53_patches.bench.sections import CHUNK, prefill_layer, representative_layers


class Profiler:
    def __init__(self, names):
        self.names = names  # id(module) -> its path in the layer
        self.exclusive = collections.Counter()
        self.calls = collections.Counter()
        self.stack = []  # [key, children's seconds]
        self.saved = []

    def _timed(self, fn, key_of):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            key = key_of(args)
            if key is None or (self.stack and self.stack[-1][0] == key):  # super() into the same call
                return fn(*args, **kwargs)
            arrays = [a for a in list(args) + list(kwargs.values()) if isinstance(a, mx.array)]
            try:
                mx.eval(arrays)
            except ValueError:  # inside a compiled function's trace: not timed
                return fn(*args, **kwargs)
            self.stack.append([key, 0.0])
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(out if isinstance(out, (mx.array, list, tuple, dict)) else [])
            elapsed = time.perf_counter() - start
            _, children = self.stack.pop()
            self.exclusive[key] += elapsed - children
            self.calls[key] += 1
            if self.stack:
                self.stack[-1][1] += elapsed
            return out

        return wrapper

    def _replace(self, owner, name, new):
        self.saved.append((owner, name, vars(owner)[name]))
        setattr(owner, name, new)

    def install(self, layer, language):
        def method_key(suffix):  # the instance's path in the layer (None: not one of its modules)
            return lambda args: self.names[id(args[0])] + suffix if args and id(args[0]) in self.names else None

        classes = {cls for m in layer.modules() for cls in type(m).__mro__
                   if issubclass(cls, nn.Module) and cls is not nn.Module}
        for cls in classes:
            for name, fn in list(vars(cls).items()):
                ours = cls.__module__ == language.__name__
                if inspect.isfunction(fn) and (name == "__call__" or (ours and not name.startswith("__"))):
                    self._replace(cls, name, self._timed(fn, method_key("" if name == "__call__" else f".{name}")))
        for name, fn in list(vars(language).items()):
            if isinstance(fn, types.FunctionType) and not name.startswith("__"):
                self._replace(language, name, self._timed(fn, lambda args, name=name: f"fn {name}"))

    def remove(self):
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)
        self.saved = []


def profile_layer(model, config, index, context, dtype):
    """The last chunk of a ``context``-token prompt through layer ``index``:
    uninstrumented (second of two runs) and instrumented milliseconds, and the rows."""
    from glm53_patches.upstream_import import import_language

    layer = model.model.layers[index]
    x = mx.random.normal((1, context, config.hc_mult, config.hidden_size), key=mx.random.key(index)).astype(dtype)
    mx.eval(x)
    head, last = x[:, :context - CHUNK], x[:, context - CHUNK:]

    def fresh():
        cache = model.make_cache()[index]
        if head.shape[1]:
            prefill_layer(layer, cache, head)
        return cache

    for _ in range(2):  # the first run compiles kernels
        cache = fresh()
        start = time.perf_counter()
        prefill_layer(layer, cache, last)
        plain = time.perf_counter() - start
    cache = fresh()
    profiler = Profiler({id(m): f"layer {index}" + (f".{path}" if path else "") for path, m in layer.named_modules()})
    profiler.install(layer, import_language())
    try:
        start = time.perf_counter()
        prefill_layer(layer, cache, last)
        instrumented = time.perf_counter() - start
    finally:
        profiler.remove()
    rows = sorted(profiler.exclusive.items(), key=lambda kv: -kv[1])
    return {"chunk_ms": plain * 1e3, "instrumented_ms": instrumented * 1e3,
            "rows": [{"what": k, "calls": profiler.calls[k], "ms": round(s * 1e3, 3)} for k, s in rows]}


def main():
    import glm53_patches
    from glm53_patches.bench import synthetic

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="the bench's small preset, float32 (a CPU dry run)")
    p.add_argument("--context", type=int, default=4096, help="prompt length; the last 2,048 tokens are profiled")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--patches", default="", help="comma list of patches to apply")
    p.add_argument("--out")
    a = p.parse_args()
    config = synthetic.text_config("small" if a.small else "real", layers=5, experts=a.experts)
    dtype = mx.float32 if a.small else mx.bfloat16
    model = synthetic.build(config, dtype=dtype)
    kda, dsa, _ = representative_layers(model.model.layers)
    names = [n for n in a.patches.split(",") if n]
    if names:
        glm53_patches.enable(names, strict=True)
    result = {"context": a.context, "experts": a.experts, "patches": names, "layers": {}}
    for kind, index in (("KDA", kda), ("DSA", dsa)):
        r = profile_layer(model, config, index, a.context, dtype)
        result["layers"][kind] = r
        print(f"{kind} layer {index}, last {CHUNK} of {a.context} tokens, patches {names or 'none'}: "
              f"{r['chunk_ms']:.1f} ms uninstrumented, {r['instrumented_ms']:.1f} ms instrumented", flush=True)
        for row in r["rows"][:25]:
            print(f"  {row['ms']:9.2f} ms  {row['calls']:4d}x  {row['what']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
