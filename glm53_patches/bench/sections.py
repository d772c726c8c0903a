"""The bench's sections: what is measured, on which layer, from which state."""

import time

import mlx.core as mx

from . import measure, synthetic

CHUNK = 2048  # the prefill step mlx-vlm uses (prefill_step_size)

SECTIONS = ("bandwidth", "kda", "decode", "graph", "verify", "dsa", "moe", "prefill", "prefill_kda", "prefill_dsa")


def representative_layers(layers):
    """(KDA, DSA, MoE) layer indices measured alone: a KDA layer and a DSA layer with its
    own indexer, each with routed experts where one has them (DSA: None without one)."""
    moe = [i for i, l in enumerate(layers) if type(l.mlp).__name__ == "Glm5NextMoE"]
    kda = next((i for i in moe if layers[i].is_linear), next(i for i, l in enumerate(layers) if l.is_linear))
    dsa = [i for i, l in enumerate(layers) if not l.is_linear and l.self_attn.indexer is not None]
    dsa_index = next((i for i in dsa if i in moe), dsa[0] if dsa else None)
    return kda, dsa_index, kda if kda in moe else (moe[0] if moe else None)


def prefill_layer(layer, cache, x):
    """``x`` [B, T, streams, hidden] through one decoder layer in the model's chunks, with
    the mask the model gives it (none at batch 1), each chunk evaluated; the last output."""
    from mlx_vlm.models.base import create_ssm_mask

    out = None
    for start in range(0, x.shape[1], CHUNK):
        h = x[:, start:start + CHUNK]
        mask = create_ssm_mask(h[:, :, 0], cache) if layer.is_linear else None
        out, _ = layer(h, mask, cache, None)
        mx.eval(out, synthetic.cache_arrays(cache))
    return out


class Bench:
    def __init__(self, args, model, config, arms, progress, save):
        self.args, self.model, self.config, self.arms = args, model, config, arms
        self.progress, self.save = progress, save
        deadline = time.monotonic() + (args.budget_s or 1e9)
        self.runner = measure.Runner(arms, progress, deadline)
        self.dtype = model.model.norm.weight.dtype  # the activations' (norms are stored in it)
        self.results = None  # set by the caller
        self._contexts = {}
        self._prefill_checked = set()
        self.kda_index, self.dsa_index, self.moe_index = representative_layers(model.model.layers)

    # -- helpers -----------------------------------------------------------------------

    def context(self, tokens):
        if tokens not in self._contexts:
            self.progress(f"filling caches at a {tokens}-token context (random contents)")
            self.arms.release()
            self._contexts[tokens] = synthetic.context_caches(self.model, tokens, self.dtype, seed=self.args.seed)
        return self._contexts[tokens]

    def _inputs(self, shape, n=16, salt=0):
        key = mx.random.key(self.args.seed * 31 + salt)
        xs = [mx.random.normal(shape, key=k).astype(self.dtype) for k in mx.random.split(key, n)]
        mx.eval(xs)
        return xs

    def _run(self, group, name, workload, steps=None, warmup=None, check_steps=None, rounds=None,
             check_workload=None, time_stock=True, pipelined_steps=0):
        """Check (against stock, bit for bit) then time; ``check_workload`` checks instead
        of ``workload``, False skips the check."""
        a = self.args
        check = {} if check_workload is False else \
            self.runner.check(check_workload or workload, check_steps or max(a.check_steps, 1))
        timed = self.runner.timed(workload, rounds or a.rounds, a.warmup if warmup is None else warmup,
                                  a.steps if steps is None else steps, time_stock, pipelined_steps)
        timed["check"] = check
        checked = f"{group}.{check_workload.name if check_workload else name}"
        for label, verdict in check.items():
            self.results["correctness"].setdefault(label, {})[checked] = verdict
            arm = timed["arms"].get(label, {})
            if "timed_tokens_match_stock" in arm:
                verdict["timed_tokens_match"] = arm["timed_tokens_match_stock"]
            if "tokens_match_stock" in arm.get("pipelined", {}):
                verdict["pipelined_tokens_match"] = arm["pipelined"]["tokens_match_stock"]
        self.results.setdefault(group, {})[name] = timed
        self.results["peak_memory"][f"{group}.{name}"] = {l: e["peak_memory"] for l, e in timed["arms"].items()}
        return timed

    # -- sections ----------------------------------------------------------------------

    def bandwidth(self):
        on_gpu = mx.default_device() == mx.gpu
        probe = measure.bandwidth(on_gpu, self.config, self.dtype, small=self.args.small)
        self.results["bandwidth"] = probe
        weights = self.results["bytes_per_token"]["weights"]
        self.results["floor_ms"] = {"copy": weights / (probe["copy_GBps"] * 1e9) * 1e3,
                                    "matvec": weights / (probe["matvec_GBps"] * 1e3 * 1e6) * 1e3}
        self.progress(f"bandwidth: copy {probe['copy_GBps']:.1f} GB/s, 8-bit matvec {probe['matvec_GBps']:.1f} GB/s")

    def kda(self):
        from mlx_vlm.models.cache import ArraysCache

        layer = self.model.model.layers[self.kda_index]
        c = self.config
        streams = self._inputs((1, 1, c.hc_mult, c.hidden_size), salt=1)
        flat = self._inputs((1, 1, c.hidden_size), salt=2)

        def make():
            return {"cache": ArraysCache(size=2)}

        def whole(s, i):
            out, _ = layer(streams[i % len(streams)], None, s["cache"], None)
            mx.eval(out, synthetic.cache_arrays(s["cache"]))
            return [out]

        def attention(s, i):
            out = layer.self_attn(flat[i % len(flat)], None, s["cache"])
            mx.eval(out, synthetic.cache_arrays(s["cache"]))
            return [out]

        final = lambda s: synthetic.cache_arrays(s["cache"])  # noqa: E731
        self._run("layers", "kda_layer", measure.Workload(f"KDA layer {self.kda_index}", make, whole, final))
        self._run("layers", "kda_attention",
                  measure.Workload(f"KDA attention {self.kda_index}", make, attention, final))

    def _decode_workload(self, tokens):
        model = self.model

        def make():
            return {"cache": synthetic.clone_cache(self.context(tokens)), "token": mx.array([[1]], dtype=mx.int32)}

        def build(s, i):
            logits = model(s["token"], cache=s["cache"]).logits[:, -1, :]
            y = mx.argmax(logits, axis=-1)
            s["token"] = y[:, None]
            return [logits, y]

        def serve(s, i):  # mlx-vlm's _step in generate_step: greedy sampling of the log-probabilities
            logits = model(s["token"], cache=s["cache"]).logits[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            y = mx.argmax(logprobs, axis=-1)
            s["token"] = y[:, None]
            return [logprobs, y]

        def final(s):
            return synthetic.cache_arrays(s["cache"])

        return measure.Workload(f"decode ctx {tokens}", make, final=final, token=lambda arrays: arrays[1].item(),
                                build=build, pipelined=serve)

    def decode(self):
        for tokens in self.args.contexts:
            if self.runner.past_deadline():
                self.results["skipped"].append(f"decode at {tokens}: time budget spent")
                continue
            workload = self._decode_workload(tokens)
            timed = self._run("decode", str(tokens), workload, pipelined_steps=self.args.pipelined_steps)
            timed["context"] = tokens
            state = synthetic.cache_arrays(
                [c for c, l in zip(self.context(tokens), self.model.model.layers) if l.is_linear])
            timed["kda_state_bytes"] = sum(a.nbytes for a in state)
            timed["cache_bytes"] = sum(a.nbytes for a in synthetic.cache_arrays(self.context(tokens)))
            self.save()

    def graph(self):
        tokens = max(self.args.contexts)
        counts = self.results["graph_primitives"]
        workloads = [("decode_step", self._decode_workload(tokens))]
        for label in self.arms.labels:
            self.arms.activate(label)
            for name, workload in workloads:
                state = workload.make()
                workload.step(state, 0)  # first step traces and compiles
                arrays = workload.build(state, 1)
                counts.setdefault(name, {})[label] = measure.count_primitives(arrays)
                mx.eval(arrays)
            self.progress(f"graph | {label:>22} | {counts['decode_step'][label]['total']} primitives per decode step")
        counts["decode_step"]["context"] = tokens
        self.arms.release()

    def verify(self):
        """Speculative verify blocks as mlx-vlm's MTP loop runs them on the target: a speculating
        cache (``start_speculative_cache``), one forward of the bonus token and L - 1 drafts, the
        greedy tokens read, then a commit of one token (every draft rejected, so the context grows by
        one per block, as in decode). L = 1 is a plain decode step, the blocks' baseline. A block is
        timed as its graph's build (the commit of the block before, the forward) and evaluation."""
        from mlx_vlm.speculative.cache_state import start_speculative_cache

        model = self.model
        for tokens in self.args.contexts:
            for length in self.args.verify_blocks:
                if self.runner.past_deadline():
                    self.results["skipped"].append(f"verify block {length} at {tokens}: time budget spent")
                    continue
                block = mx.random.randint(0, self.config.vocab_size, (1, length), key=mx.random.key(length))

                def make(tokens=tokens):
                    return {"cache": synthetic.clone_cache(self.context(tokens)), "transaction": None}

                def commit(s):
                    if s["transaction"] is not None:
                        s["transaction"].commit([1])
                        s["transaction"] = None

                def build(s, i, block=block, length=length):
                    commit(s)
                    cache = s["cache"]
                    if length > 1:
                        s["transaction"] = start_speculative_cache(cache, length)
                    logits = model(block, cache=cache).logits
                    return [logits, mx.argmax(logits, axis=-1)]

                def final(s):
                    commit(s)
                    return synthetic.cache_arrays(s["cache"])

                workload = measure.Workload(f"verify block {length} ctx {tokens}", make, final=final, build=build,
                                            token=lambda arrays: arrays[1][0, 0].item())
                timed = self._run("verify", f"{tokens}/{length}", workload)
                timed.update(context=tokens, block=length)
                self.save()

    def dsa(self):
        if self.dsa_index is None:
            self.results["skipped"].append("dsa: the model has no DSA layer with an indexer")
            return
        layer = self.model.model.layers[self.dsa_index]
        attn, c = layer.self_attn, self.config
        streams = self._inputs((1, 1, c.hc_mult, c.hidden_size), salt=3)
        flat = self._inputs((1, 1, c.hidden_size), salt=4)
        q_resid = self._inputs((1, 1, c.q_lora_rank), salt=6)

        def whole(s, i):
            out, _ = layer(streams[i % len(streams)], None, s["cache"], None)
            mx.eval(out, synthetic.cache_arrays(s["cache"]))
            return [out]

        def attention(s, i):
            out, topk = attn(flat[i % len(flat)], None, s["cache"], None)
            mx.eval(out, topk, synthetic.cache_arrays(s["cache"]))
            return [out, topk]

        def indexer(s, i):  # the indexer alone, as attention calls it for one token
            cache = s["cache"]
            topk = attn.indexer(flat[i % len(flat)], q_resid[i % len(q_resid)], None, cache[1], cache[2],
                                cache[0].offset)
            cache[0].offset += 1  # the latent cache advances with the indexer's own caches
            mx.eval(topk, synthetic.cache_arrays(cache))
            return [topk]

        final = lambda s: synthetic.cache_arrays(s["cache"])  # noqa: E731
        # Every decode context: the DSA layers are the ones whose cost grows with it.
        for tokens in self.args.contexts:
            def make(tokens=tokens):
                return {"cache": synthetic.clone_cache(self.context(tokens)[self.dsa_index])}

            self.context(tokens)
            for name, fn in (("dsa_layer", whole), ("dsa_attention", attention), ("dsa_indexer", indexer)):
                workload = measure.Workload(f"{name} {self.dsa_index} ctx {tokens}", make, fn, final)
                timed = self._run("layers", f"{name}@{tokens}", workload)
                timed["context"] = tokens

    def moe(self):
        if self.moe_index is None:
            self.results["skipped"].append("moe: the model has no MoE layer")
            return
        mlp = self.model.model.layers[self.moe_index].mlp
        flat = self._inputs((1, 1, self.config.hidden_size), salt=5)

        def step(s, i):
            out = mlp(flat[i % len(flat)])
            mx.eval(out)
            return [out]

        self._run("layers", "moe_block", measure.Workload(f"MoE block {self.moe_index}", dict, step))

    def _prefill(self, key, length, make, step, final=lambda s: [], token=None, short_step=None, family="model"):
        """One fresh-cache prefill of ``length`` tokens per run; tokens/s beside the ms.
        With --prefill-check-tokens, ``short_step`` (the prompt's first N tokens) is the
        check and warm-up, run once per ``family`` (model, or one layer)."""
        workload = measure.Workload(f"prefill {key}", make, step, final, token=token, unit="ms")
        check = None
        if short_step is not None:
            name = f"{family} first {self.args.prefill_check_tokens} tokens"
            check = False if name in self._prefill_checked else \
                measure.Workload(name, make, short_step, final, token=token, unit="ms")
            self._prefill_checked.add(name)
        timed = self._run("prefill", key, workload, steps=1, warmup=0, check_steps=1,
                          rounds=self.args.prefill_rounds, check_workload=check,
                          time_stock=not self.args.prefill_untimed_stock)
        for entry in timed["arms"].values():
            entry["tokens_per_s"] = length / entry["median"] * 1e3
            entry["tokens_per_s_min"] = length / entry["max"] * 1e3
            entry["tokens_per_s_max"] = length / entry["min"] * 1e3
        timed["length"] = length
        self.save()

    def _lengths(self, what):
        for length in self.args.prefill:
            if self.runner.past_deadline():
                self.results["skipped"].append(f"{what} {length}: time budget spent")
            else:
                yield length

    def _short(self, length, short_step):
        n = self.args.prefill_check_tokens
        return short_step if n and n < length else None

    def prefill(self):
        model = self.model
        for length in self._lengths("prefill"):
            prompt = mx.random.randint(0, self.config.vocab_size, (1, length), key=mx.random.key(length))

            def make():
                return {"cache": model.make_cache()}

            def step(s, i, prompt=prompt):
                logits = None
                for start in range(0, prompt.shape[1], CHUNK):
                    logits = model(prompt[:, start:start + CHUNK], cache=s["cache"], num_logits_to_keep=1).logits
                    mx.eval(logits, synthetic.cache_arrays(s["cache"]))
                return [logits[:, -1, :], mx.argmax(logits[:, -1, :], axis=-1)]

            short = self._short(length, lambda s, i, p=prompt: step(s, i, p[:, :self.args.prefill_check_tokens]))
            self._prefill(str(length), length, make, step, token=lambda arrays: arrays[1].item(), short_step=short)

    def _prefill_layer(self, kind, index):
        """One decoder layer (both hyper-connections, attention, FFN) over a prompt, in
        the model's chunks and with the mask the model gives it (none at batch 1)."""
        model, layer, c = self.model, self.model.model.layers[index], self.config

        def make():
            return {"cache": model.make_cache()[index]}

        def final(s):
            return synthetic.cache_arrays(s["cache"])

        for length in self._lengths(f"prefill {kind} layer"):
            x = mx.random.normal((1, length, c.hc_mult, c.hidden_size), key=mx.random.key(length)).astype(self.dtype)
            mx.eval(x)

            def step(s, i, x=x):
                return [prefill_layer(layer, s["cache"], x)[:, -1]]

            short = self._short(length, lambda s, i, x=x: step(s, i, x[:, :self.args.prefill_check_tokens]))
            self._prefill(f"{kind} layer {index} @{length}", length, make, step, final, short_step=short,
                          family=f"{kind} layer {index}")

    def prefill_kda(self):
        self._prefill_layer("KDA", self.kda_index)

    def prefill_dsa(self):
        if self.dsa_index is None:
            self.results["skipped"].append("prefill_dsa: the model has no DSA layer with an indexer")
            return
        self._prefill_layer("DSA", self.dsa_index)
