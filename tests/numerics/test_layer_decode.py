"""layer_decode: a decode step through compiled layer functions is bit-identical to stock.

Every expected value comes from running the stock mlx-vlm code (layer_decode
reverted, or never applied) in the same process on the same inputs; nothing is
copied from the code under test. Counts expected (layers, kinds, traces) are
derived from the model's own structure.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

import glm53_patches
from glm53_patches import registry
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch
from glm53_patches.patches import layer_decode
from glm53_patches.tiny_model import build_model, greedy_logits
from glm53_patches.exactness import cache_fields, same_bits

STEPS = 64
NAME = "layer_decode"
# The exact decode patches GLM53_PATCHES=all applies (their kernels stay off on the CPU).
DECODE = ["compiled_kda_decode", "fused_kda_kernel", "hc_decode", "router_select", "expert_combine", "dsa_decode"]
TARGET = f"{GLM5_NEXT}:Glm5NextTextModel.__call__"
PROMPT = [3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]


@pytest.fixture(scope="module")
def fp32_model():
    return build_model(quantize_bits=None, seed=0)


@pytest.fixture(scope="module")
def q4_model():
    return build_model(quantize_bits=4, seed=0)


def enable(*names):
    state = glm53_patches.enable(list(names), strict=True)
    for name in names:
        assert state[name]["state"] == "applied", state[name]
    layer_decode.PATCH.stats.reset()


def counts():
    snapshot = layer_decode.PATCH.stats.snapshot()
    return snapshot["hits"], snapshot["fallbacks"]


# -- comparing everything a decode leaves behind ----------------------------------------------


def assert_same(expected, actual, what="value"):
    assert type(expected) is type(actual), what
    if isinstance(expected, mx.array):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, what
        assert expected.size == 0 or same_bits(expected, actual), f"{what} differs"
    else:
        assert expected == actual, what


def assert_same_decode(expected, actual):
    (logits_a, cache_a), (logits_b, cache_b) = expected, actual
    assert len(logits_a) == len(logits_b)
    for step, (a, b) in enumerate(zip(logits_a, logits_b)):
        assert_same(a, b, f"logits at step {step}")
    assert [t.argmax(-1).tolist() for t in logits_a] == [t.argmax(-1).tolist() for t in logits_b]
    state_a, state_b = cache_fields(cache_a), cache_fields(cache_b)
    assert [p for p, _ in state_a] == [p for p, _ in state_b]
    assert sum(isinstance(v, mx.array) for _, v in state_a) > 20  # every layer's cache arrays were compared
    for (path, a), (_, b) in zip(state_a, state_b):
        assert_same(a, b, path)


def decode(language_model, tokens, steps=STEPS, cache=None):
    """Prefill, then greedy single-token steps: every step's logits, and the cache after."""
    cache = language_model.make_cache() if cache is None else cache
    return greedy_logits(language_model, tokens, steps, cache=cache), cache


def left_padded_batch(language_model):
    """Three prompts of different lengths, left-padded, with mlx-vlm's batch caches (as the server makes them)."""
    from glm53_patches.patches.layer_decode.checks.bench import prompt

    return prompt(language_model, 3)


# -- what the model's structure says to expect -------------------------------------------------


def layer_kinds(language_model):
    """{kind: layers}: attention (KDA, DSA computing or sharing its selection) x feed-forward."""
    kinds = {}
    for layer in language_model.layers:
        attention = "kda" if layer.is_linear else ("dsa-shared" if layer.self_attn.indexer is None else "dsa")
        kind = (attention, type(layer.mlp).__name__)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def expected_traces(language_model):
    """Compiled functions per model: one per KDA kind, two (either side of the cache update) per DSA kind."""
    return sum(1 if attention == "kda" else 2 for attention, _ in layer_kinds(language_model))


def expected_hits(language_model, steps):
    kda = sum(layer.is_linear for layer in language_model.layers)
    return {"kda layer": steps * kda, "dsa layer": steps * (len(language_model.layers) - kda)}


# -- exactness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("others", [(), tuple(DECODE)], ids=["alone", "with-decode-patches"])
@pytest.mark.parametrize("which", ["fp32_model", "q4_model"])
def test_greedy_decode_bit_identical_batch_1(request, which, others):
    language_model = request.getfixturevalue(which).language_model
    prompt = mx.array([PROMPT])
    enable(*others)
    expected = decode(language_model, prompt)  # the other patches alone (each is bit-identical to stock)
    glm53_patches.disable()
    stock = decode(language_model, prompt)
    assert_same_decode(stock, expected)

    enable(*others, NAME)
    patches = registry.available()
    before = {name: patches[name].stats.snapshot() for name in others}
    actual = decode(language_model, prompt)
    assert_same_decode(stock, actual)
    if others:  # the other patches' code ran inside: traced once per kind, or (the indexer) every step
        rose = {name: patches[name].stats.snapshot() != before[name] for name in others}
        assert all(rose.values()), rose
        full_dsa = sum(not layer.is_linear and layer.self_attn.indexer is not None for layer in language_model.layers)
        indexer = patches["dsa_decode"].stats.snapshot()["hits"]["indexer"] - before["dsa_decode"]["hits"].get("indexer", 0)
        assert indexer == STEPS * full_dsa
    hits, fallbacks = counts()
    assert {k: v for k, v in hits.items() if "layer" in k} == expected_hits(language_model, STEPS)
    # One trace per layer kind and function, none again; the prefill stepped aside.
    assert hits["trace"] == expected_traces(language_model) and "retrace" not in hits
    assert fallbacks == {"length": 1}


def test_attention_mask_embeddings_and_hidden_states_as_stock(fp32_model):
    """The step's other inputs and outputs: a padding mask (sliced to the token), embeddings, hidden states."""
    language_model = fp32_model.language_model
    prompts = mx.array([PROMPT, PROMPT[::-1]])

    def run():
        cache = language_model.make_cache()
        logits = language_model(prompts, cache=cache).logits[:, -1]
        out = [logits]
        for step in range(6):
            mask = mx.array([[True] * (len(PROMPT) + step + 1), [True] * (len(PROMPT) + step) + [step % 2 == 0]])
            token = mx.argmax(logits, axis=-1)[:, None]
            if step % 3 == 2:  # as embeddings rather than ids
                result = language_model(None, cache=cache, inputs_embeds=language_model.model.embed_tokens(token),
                                        attention_mask=mask, return_hidden=True)
            else:
                result = language_model(token, cache=cache, attention_mask=mask, return_hidden=True)
            logits = result.logits[:, -1]
            out += [logits, *result.hidden_states]
            mx.eval(out)
        return out, cache

    stock = run()
    enable(*DECODE, NAME)
    actual = run()
    assert_same_decode(stock, actual)
    assert counts()[0]["dsa layer"] == 6 * sum(not layer.is_linear for layer in language_model.layers)


def decode_padded(language_model, prefill=2):
    """The left-padded batch: a short prefill, then the rest of the prompts one column per step
    (so the padded rows decode padding, masked), then greedy steps to STEPS decode steps in all."""
    tokens, cache = left_padded_batch(language_model)
    logits = [language_model(tokens[:, :prefill], cache=cache).logits[:, -1]]
    for column in range(prefill, tokens.shape[1]):
        logits.append(language_model(tokens[:, column:column + 1], cache=cache).logits[:, -1])
        mx.eval(logits[-1])
    forced = tokens.shape[1] - prefill
    more, cache = decode(language_model, mx.argmax(logits[-1], axis=-1)[:, None], steps=STEPS - forced - 1, cache=cache)
    return logits + more, cache


@pytest.mark.parametrize("which", ["fp32_model", "q4_model"])
def test_left_padded_batch_bit_identical(request, which):
    language_model = request.getfixturevalue(which).language_model
    stock = decode_padded(language_model)

    enable(*DECODE, NAME)
    actual = decode_padded(language_model)
    assert_same_decode(stock, actual)
    hits, fallbacks = counts()
    assert {k: v for k, v in hits.items() if "layer" in k} == expected_hits(language_model, STEPS)
    assert hits["trace"] == expected_traces(language_model) and "retrace" not in hits  # the masked KDA forms
    assert fallbacks == {"length": 1}


def test_one_trace_per_kind_and_shape(fp32_model):
    """A new batch size retraces each function once (counted); repeats trace nothing."""
    language_model = fp32_model.language_model
    enable(NAME)
    traces = expected_traces(language_model)
    for _ in range(2):
        decode(language_model, mx.array([PROMPT]), steps=3)
    assert counts()[0]["trace"] == traces and "retrace" not in counts()[0]
    for _ in range(2):
        decode(language_model, mx.array([PROMPT, PROMPT[::-1]]), steps=3)
    hits = counts()[0]
    assert hits["trace"] == traces and hits["retrace"] == traces
    assert hits["kda layer"] + hits["dsa layer"] == 4 * 3 * len(language_model.layers)


def test_weights_are_inputs_not_captured(fp32_model):
    """Weights changed between steps are seen without a retrace (nothing baked into the trace)."""
    language_model = fp32_model.language_model
    norms = [layer.input_layernorm for layer in language_model.layers]
    originals = [norm.weight for norm in norms]

    def run():
        logits, cache = decode(language_model, mx.array([PROMPT]), steps=4)
        for norm in norms:
            norm.weight = norm.weight * 1.5
        more, cache = decode(language_model, mx.array([[PROMPT[0]]]), steps=4, cache=cache)
        for norm, weight in zip(norms, originals):
            norm.weight = weight
        return logits + more, cache

    stock = run()
    enable(NAME)
    actual = run()
    assert_same_decode(stock, actual)
    assert counts()[0]["trace"] == expected_traces(language_model) and "retrace" not in counts()[0]


def test_a_module_tree_changed_in_place_is_traced_afresh():
    """Quantizing a model after it decoded: the new parameters retrace, bound to the live modules."""

    def run():
        model = build_model(quantize_bits=None, seed=3).language_model
        logits, cache = decode(model, mx.array([PROMPT]), steps=3)
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and "gate" not in p and m.weight.shape[-1] % 32 == 0)
        return decode(model, mx.array([[PROMPT[1]]]), steps=6, cache=cache)

    stock = run()
    enable(NAME)
    actual = run()
    assert_same_decode(stock, actual)
    assert counts()[0]["retrace"] > 0


def test_a_swapped_method_is_traced_afresh(fp32_model):
    """Code installed over an upstream method (a test's or a verify's swap) is what the next step traces."""
    from mlx_vlm.models.glm5_next import language

    language_model = fp32_model.language_model
    original = language.MoEGate.__dict__["__call__"]

    def halved(self, x):  # changes the numbers, so a stale trace would show
        indices, weights = original(self, x)
        return indices, weights * 0.5

    enable(NAME)
    before = decode(language_model, mx.array([PROMPT]), steps=4)
    language.MoEGate.__call__ = halved
    try:
        actual = decode(language_model, mx.array([PROMPT]), steps=4)
        glm53_patches.disable()
        expected = decode(language_model, mx.array([PROMPT]), steps=4)
    finally:
        language.MoEGate.__call__ = original
    assert_same_decode(expected, actual)
    assert not mx.array_equal(before[0][-1], actual[0][-1]).item()


# -- stepping aside ----------------------------------------------------------------------------


def _kda_caches(cache):
    from mlx_vlm.models.cache import ArraysCache

    return [c for c in cache if isinstance(c, ArraysCache)]


def _speculating(cache):
    for layer_cache in _kda_caches(cache):
        layer_cache.start_speculation(1)


def _ragged(cache):
    for layer_cache in _kda_caches(cache):
        layer_cache.lengths = mx.array([len(PROMPT) + 1])


@pytest.mark.parametrize("case", ["speculating", "ragged", "short chunk"])
def test_speculating_records_while_ragged_caches_and_short_chunks_step_aside(fp32_model, case):
    """A one-token step on speculating caches runs compiled and hands the history it recorded to the
    cache; ragged KDA caches run those layers eagerly (the DSA layers stay compiled); a few tokens
    while nothing speculates (a prompt's last chunk) are prefill: stock."""
    language_model = fp32_model.language_model
    kda = sum(layer.is_linear for layer in language_model.layers)
    dsa = len(language_model.layers) - kda
    after = mx.array([PROMPT[:3]]) if case == "short chunk" else mx.array([[PROMPT[2]]])

    def run():
        logits, cache = decode(language_model, mx.array([PROMPT]), steps=1)
        {"speculating": _speculating, "ragged": _ragged}.get(case, lambda _: None)(cache)
        step = language_model(after, cache=cache).logits
        if case == "speculating":  # the history recorded is there to commit
            for layer_cache in _kda_caches(cache):
                layer_cache.commit_speculation([1])
        return [*logits, step], cache

    stock = run()
    enable(NAME)
    actual = run()
    assert_same_decode(stock, actual)
    hits, fallbacks = counts()
    layers = {kind: n for kind, n in hits.items() if kind.startswith(("kda", "dsa"))}
    assert (layers, fallbacks) == {
        "speculating": ({"kda layer": 2 * kda, "dsa layer": 2 * dsa}, {"length": 1}),
        "ragged": ({"kda layer": kda, "dsa layer": 2 * dsa}, {"length": 1, "ragged": kda}),
        "short chunk": ({"kda layer": kda, "dsa layer": dsa}, {"length": 2}),  # the prompt and the chunk
    }[case]


def test_verify_blocks_step_aside_on_metal(fp32_model, monkeypatch):
    """On Metal stock runs verify blocks through its own exact block kernels: the whole block is stock's
    there, while the decode steps between blocks stay compiled."""
    from glm53_patches.patches.layer_decode import step
    from glm53_patches.tiny_model import speculative_logits

    language_model = fp32_model.language_model
    rounds = 3
    stock = speculative_logits(language_model, mx.array([PROMPT]), rounds)
    monkeypatch.setattr(step, "gpu_backend", lambda: "metal")  # what the plan asks; the arithmetic stays the CPU's
    enable(NAME)
    actual = speculative_logits(language_model, mx.array([PROMPT]), rounds)
    assert_same_decode(stock, actual)
    hits, fallbacks = counts()
    assert fallbacks == {"length": 1, "metal verify block": rounds}
    assert hits["kda layer"] == rounds * sum(layer.is_linear for layer in language_model.layers)
    assert "kda block" not in hits and "dsa block" not in hits


def test_steps_aside_for_prefill_training_and_no_cache(fp32_model):
    language_model = fp32_model.language_model
    tokens = mx.array([[PROMPT[0]]])
    stock = language_model(tokens).logits
    language_model.train()
    try:
        stock_training = language_model(tokens, cache=language_model.make_cache()).logits
        enable(NAME)
        training = language_model(tokens, cache=language_model.make_cache()).logits
    finally:
        language_model.eval()
    assert_same(stock_training, training)
    assert_same(stock, language_model(tokens).logits)
    assert counts() == ({}, {"training": 1, "no cache": 1})


class _Plugin:
    def __init__(self, *patches):
        self.patches = list(patches)

    @hookimpl
    def glm53_patches(self):
        return self.patches


def test_steps_aside_for_a_patch_it_does_not_know(fp32_model, monkeypatch):
    """Another plugin's wrapper on a method inside the layers: it must see every call, so the step stays stock."""
    monkeypatch.setattr(registry, "_extra_plugins", [])
    monkeypatch.setattr(registry, "_plugins", None)

    def factory(inner):
        def wrapper(*args, **kwargs):
            probe.stats.hit()
            return inner(*args, **kwargs)

        return wrapper

    probe = Patch(name="probe", summary="counts calls", targets={f"{GLM5_NEXT}:MoEGate.__call__": factory},
                  fingerprints_file=str(registry.available()["router_select"].fingerprints_path()))  # verifies MoEGate
    registry.register_plugin(_Plugin(probe))
    language_model = fp32_model.language_model
    try:
        stock = decode(language_model, mx.array([PROMPT]), steps=4)
        enable(NAME, "probe")
        actual = decode(language_model, mx.array([PROMPT]), steps=4)
        moe_layers = sum(type(layer.mlp).__name__ == "Glm5NextMoE" for layer in language_model.layers)
        assert probe.stats.hits == 5 * moe_layers  # every call, prefill and decode
        assert counts() == ({}, {"length": 1, "probe patches MoEGate.__call__": 4})
        registry.revert(["probe"])  # without it, the compiled path again
        again = decode(language_model, mx.array([PROMPT]), steps=4)
        assert counts()[0]["kda layer"] > 0
    finally:
        registry.revert()
        registry._plugins = None
    assert_same_decode(stock, actual)
    assert_same_decode(stock, again)


# -- composition, revert, graph ----------------------------------------------------------------


def test_reverting_a_composed_patch_replans(q4_model):
    language_model = q4_model.language_model
    stock = decode(language_model, mx.array([PROMPT]), steps=8)
    enable(*DECODE, NAME)
    assert_same_decode(stock, decode(language_model, mx.array([PROMPT]), steps=8))
    traces = counts()[0]["trace"]
    glm53_patches.disable(["hc_decode"])
    assert_same_decode(stock, decode(language_model, mx.array([PROMPT]), steps=8))
    assert counts()[0]["trace"] == 2 * traces  # new functions for the new composition
    assert "hc_decode" not in layer_decode.step.report()


def test_composes_with_a_prefill_patch_on_linear(q4_model, monkeypatch):
    """dequantized_linear wraps glm5_next's linear for prefill: the steps stay on this path, and stock's bits."""
    from glm53_patches.patches.dequantized_linear import PATCH as DEQUANTIZED, linear

    monkeypatch.setenv("GLM53_DEQUANTIZED_LINEAR_FAST_PATH", "1")  # the CPU takes it only when forced
    monkeypatch.setenv("GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS", str(len(PROMPT)))
    linear.clear()
    language_model = q4_model.language_model
    stock = decode(language_model, mx.array([PROMPT]), steps=8)
    enable(DEQUANTIZED.name, NAME)
    before = DEQUANTIZED.stats.snapshot()["hits"].get("dequantized", 0)
    assert_same_decode(stock, decode(language_model, mx.array([PROMPT]), steps=8))
    assert DEQUANTIZED.stats.snapshot()["hits"].get("dequantized", 0) > before  # the prefill dequantized
    hits, fallbacks = counts()
    assert {k: v for k, v in hits.items() if "layer" in k} == expected_hits(language_model, 8)
    assert fallbacks == {"length": 1}
    linear.clear()


PREFILL_ONLY = sorted(name for name, patch in registry.available().items() if patch.prefill_only)


def test_the_prefill_patches_declare_it():
    # The MoE and linear prefill patches among them: with batched_experts not declared, GLM53_PATCHES=all
    # plus batched_experts made every decode step step aside ("batched_experts patches MoE.__call__").
    assert {"batched_experts", "dequantized_experts", "dequantized_linear"} <= set(PREFILL_ONLY)


@pytest.mark.parametrize("name", PREFILL_ONLY)
def test_a_prefill_only_patch_leaves_every_step_on_this_path(q4_model, name):
    """A patch declaring ``prefill_only``: decode steps stay compiled with the bits the patch alone gives
    (stock's, for an exact one), and none of them is a hit of the patch (it hands each single token on)."""
    language_model = q4_model.language_model
    prompt = mx.array([PROMPT * 2])  # 24 tokens: a prefill, past the 8-token short blocks
    enable(name)
    alone = decode(language_model, prompt, steps=8)
    glm53_patches.disable()
    enable(name, NAME)
    patch = registry.available()[name]
    cache = language_model.make_cache()
    logits = [language_model(prompt, cache=cache).logits[:, -1]]
    mx.eval(logits)
    prefill_hits = patch.stats.snapshot()["hits"]
    for _ in range(8):
        logits.append(language_model(mx.argmax(logits[-1], axis=-1)[:, None], cache=cache).logits[:, -1])
        mx.eval(logits[-1])
    assert patch.stats.snapshot()["hits"] == prefill_hits
    assert_same_decode(alone, (logits, cache))
    hits, fallbacks = counts()
    assert {k: v for k, v in hits.items() if "layer" in k} == expected_hits(language_model, 8)
    assert fallbacks == {"length": 1}


def test_revert_restores_the_original_object(fp32_model):
    from mlx_vlm.models.glm5_next import language

    original = language.Glm5NextTextModel.__dict__["__call__"]
    enable(NAME)
    assert language.Glm5NextTextModel.__dict__["__call__"] is not original
    decode(fp32_model.language_model, mx.array([PROMPT]), steps=2)
    assert layer_decode.step._FUNCTIONS and layer_decode.step._PLANS
    glm53_patches.disable([NAME])
    assert language.Glm5NextTextModel.__dict__["__call__"] is original
    assert list(layer_decode.PATCH.targets) == [TARGET]
    assert not layer_decode.step._FUNCTIONS and not layer_decode.step._PLANS


def test_fewer_primitives_per_step_than_the_other_patches(fp32_model):
    """Graph primitives of one decode step (deterministic)."""
    from glm53_patches.bench.measure import count_primitives

    language_model = fp32_model.language_model

    def primitives():
        logits, cache = decode(language_model, mx.array([PROMPT]), steps=2)
        step = language_model(mx.array([[PROMPT[0]]]), cache=cache).logits
        return count_primitives([step])["total"]

    stock = primitives()
    enable(*DECODE)
    others = primitives()
    enable(NAME)
    fused = primitives()
    assert fused < others < stock


def test_status_reports_kinds_and_traces(fp32_model):
    enable(*DECODE, NAME)
    decode(fp32_model.language_model, mx.array([PROMPT]), steps=2)
    entry = registry.status()["patches"][NAME]
    assert entry["stats"]["hits"]["trace"] == expected_traces(fp32_model.language_model)
    kinds = layer_kinds(fp32_model.language_model)
    for attention in ("kda", "dsa", "dsa-shared"):
        layers = sum(n for (a, _), n in kinds.items() if a == attention)
        assert f"{attention} x{layers}" in entry["detail"], entry["detail"]
    assert f"{expected_traces(fp32_model.language_model)} traces + 0 retraces" in entry["detail"], entry["detail"]
    assert "hc_decode" in entry["detail"]


def test_verify_reports_exact_on_this_backend():
    result = layer_decode.PATCH.verify()
    assert set(result) == {"exact", "max_abs_diff", "cases", "detail", "case_results"}
    assert len(result["case_results"]) == result["cases"]
    assert result["exact"] is True, result["detail"]
    assert result["cases"] >= 8 and result["max_abs_diff"] == 0.0
    assert registry.applied() == []  # verify leaves the process as it found it
