"""Apply / revert: declared targets, exact originals back, composition, drift, rollback."""

import itertools
import random
import threading

import pytest

from glm53_patches import drift, registry
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch

KDA_CALL = f"{GLM5_NEXT}:Glm5NextLinearAttention.__call__"
# Test patches replace the method compiled_kda_decode replaces: its fingerprints verify that object.
KDA_PRINTS = str(registry.available()["compiled_kda_decode"].fingerprints_path())


def _raw(target):
    chain_owner, attr, _ = __import__("wrapt").resolve_path(*drift.split_target(target))
    return chain_owner, attr, vars(chain_owner).get(attr)


class _Plugin:
    def __init__(self, *patches):
        self.patches = list(patches)

    @hookimpl
    def glm53_patches(self):
        return self.patches


def counting_patch(name, target=KDA_CALL, **kwargs):
    """A real patch that counts calls and delegates to whatever it wraps."""

    def factory(inner):
        def wrapper(*args, **kw):
            patch.stats.hit()
            return inner(*args, **kw)

        return wrapper

    patch = Patch(name=name, summary="counts calls", targets={target: factory}, fingerprints_file=KDA_PRINTS, **kwargs)
    return patch


@pytest.fixture
def extra_plugins(monkeypatch):
    """Register test-only plugins for one test, then forget them."""
    monkeypatch.setattr(registry, "_extra_plugins", [])
    monkeypatch.setattr(registry, "_plugins", None)

    def add(*patches):
        registry.register_plugin(_Plugin(*patches))
        return patches

    yield add
    registry.revert()
    registry._plugins = None


def _originals():
    targets = {t for p in registry.available().values() for t in p.targets}
    return {t: _raw(t)[2] for t in targets}


def _assert_restored(originals):
    for target, original in originals.items():
        assert _raw(target)[2] is original, target


def test_every_patch_alone_applies_and_reverts_to_the_same_objects():
    originals = _originals()
    for name, patch in registry.available().items():
        registry.apply([name], strict=True)
        for target in patch.targets:
            assert _raw(target)[2] is not originals[target]
        registry.revert([name])
        _assert_restored(originals)


def _orders(patches, samples=24):
    """Every order of each group of patches that replace one target (the others
    after them), forward and reverse, then seeded random orders up to ``samples``:
    every order of eight patches would be 40,320 runs."""
    names = list(patches)
    sharing = {}
    for name, patch in patches.items():
        for target in patch.targets:
            sharing.setdefault(target, []).append(name)
    groups = {tuple(group) for group in sharing.values() if len(group) > 1}
    orders = {tuple(names), tuple(reversed(names))}
    for group in groups:
        rest = tuple(n for n in names if n not in group)
        orders |= {perm + rest for perm in itertools.permutations(group)}
    rng = random.Random(0)
    while len(orders) < samples:
        orders.add(tuple(rng.sample(names, len(names))))
    return groups, sorted(orders)


def test_all_patches_in_many_orders():
    groups, orders = _orders(registry.available())
    assert groups, "no two patches share a target: composition is not exercised"
    originals = _originals()
    for order in orders:
        registry.apply(order, strict=True)
        assert registry.applied() == list(order)
        registry.revert(list(order[1::2]) + list(order[0::2]))  # interleaved revert order
        _assert_restored(originals)


def test_apply_is_idempotent():
    name = next(iter(registry.available()))
    registry.apply([name])
    once = {t: _raw(t)[2] for t in registry.available()[name].targets}
    registry.apply([name])
    assert {t: _raw(t)[2] for t in once} == once


def test_two_patches_on_one_method_both_engage(extra_plugins, tiny_fp32_dir):
    import mlx.core as mx
    from mlx_vlm.utils import load

    first, second = extra_plugins(counting_patch("probe_a"), counting_patch("probe_b"))
    model, _ = load(str(tiny_fp32_dir))
    for order in (["probe_a", "probe_b", "compiled_kda_decode"], ["compiled_kda_decode", "probe_b", "probe_a"]):
        registry.apply(order, strict=True)
        kda = registry.available()["compiled_kda_decode"]
        before = (first.stats.hits, second.stats.hits, kda.stats.hits)
        cache = model.language_model.make_cache()
        logits = model.language_model(mx.array([[1, 2, 3, 4]]), cache=cache).logits
        for token in (5, 6):
            logits = model.language_model(mx.array([[token]]), cache=cache).logits
        mx.eval(logits)
        after = (first.stats.hits, second.stats.hits, kda.stats.hits)
        assert all(a > b for a, b in zip(after, before)), (order, before, after)
        registry.revert(["probe_b"])  # the others still engage without it
        mid = (first.stats.hits, second.stats.hits, kda.stats.hits)
        cache = model.language_model.make_cache()  # prefill reaches the inner probe, decode the fast path
        model.language_model(mx.array([[1, 2, 3]]), cache=cache)
        mx.eval(model.language_model(mx.array([[7]]), cache=cache).logits)
        assert first.stats.hits > mid[0] and kda.stats.hits > mid[2] and second.stats.hits == mid[1]
        registry.revert()


def ordered_probe(name, seen, **kwargs):
    """A probe that records the order in which a call reaches it, then delegates."""

    def factory(inner):
        def wrapper(*args, **kw):
            seen.append(name)
            return inner(*args, **kw)

        return wrapper

    return Patch(name=name, summary="records call order", targets={KDA_CALL: factory}, fingerprints_file=KDA_PRINTS,
                 **kwargs)


def test_declared_order_wins_over_the_order_of_enabling(extra_plugins, tiny_fp32_dir):
    """`runs_before` decides which patch on a shared target is called first, in both enable orders."""
    import mlx.core as mx
    from mlx_vlm.utils import load

    seen = []
    extra_plugins(ordered_probe("outer", seen, runs_before=("middle",)), ordered_probe("middle", seen, runs_before=("inner",)),
                  ordered_probe("inner", seen), ordered_probe("loose", seen))
    model, _ = load(str(tiny_fp32_dir))
    for order in (["inner", "middle", "outer"], ["outer", "middle", "inner"], ["middle", "outer", "inner"]):
        registry.apply(order, strict=True)
        seen.clear()
        cache = model.language_model.make_cache()
        mx.eval(model.language_model(mx.array([[1, 2, 3]]), cache=cache).logits)
        per_layer = seen[:3]
        assert per_layer == ["outer", "middle", "inner"], (order, seen[:6])
        registry.revert()
    # undeclared pairs keep the rule they always had: the later applied is outside
    registry.apply(["inner", "loose"], strict=True)
    seen.clear()
    cache = model.language_model.make_cache()
    mx.eval(model.language_model(mx.array([[1, 2]]), cache=cache).logits)
    assert seen[:2] == ["loose", "inner"]


@pytest.mark.parametrize("order", [["fused_kda_kernel", "compiled_kda_decode"], ["compiled_kda_decode", "fused_kda_kernel"]])
def test_the_fused_kernel_wraps_the_compiled_step_in_both_orders(order):
    import glm53_patches

    glm53_patches.enable(order, strict=True)
    owner, attr, installed = _raw(KDA_CALL)
    assert "fused_kda_kernel" in installed.__code__.co_filename, installed.__code__.co_filename


def test_partial_apply_rolls_back(extra_plugins):
    originals = _originals()
    good_then_bad = Patch(
        name="half",
        summary="second target does not exist",
        targets={KDA_CALL: lambda inner: (lambda *a, **k: inner(*a, **k)),
                 f"{GLM5_NEXT}:NoSuchClass.__call__": lambda inner: inner},
    )
    extra_plugins(good_then_bad)
    result = registry.apply(["half"], force={"half"})
    assert result["half"]["state"] == "error"
    assert registry.applied() == []
    _assert_restored(originals)
    with pytest.raises(registry.PatchError):
        registry.apply(["half"], force={"half"}, strict=True)


def test_drift_refuses_unless_forced(extra_plugins, monkeypatch):
    originals = _originals()
    (probe,) = extra_plugins(counting_patch("probe_a"))
    result = registry.apply(["probe_a"])  # its target is known, but only for compiled_kda_decode's entry
    assert result["probe_a"]["state"] == "applied"
    registry.revert()
    monkeypatch.setattr(drift, "load_known", lambda path: {})
    result = registry.apply(["probe_a"])
    assert result["probe_a"]["state"] == "drift" and "never verified" in result["probe_a"]["reason"]
    _assert_restored(originals)
    with pytest.raises(registry.PatchError):
        registry.apply(["probe_a"], strict=True)
    result = registry.apply(["probe_a"], force={"probe_a"})
    assert result["probe_a"]["state"] == "applied" and result["probe_a"]["forced"]


def test_revert_calls_on_revert(extra_plugins):
    dropped = []
    extra_plugins(counting_patch("probe_a", on_revert=lambda: dropped.append(True)))
    registry.apply(["probe_a"])
    registry.revert(["probe_a"])
    assert dropped == [True]


def test_concurrent_apply_and_revert_end_consistent(extra_plugins):
    extra_plugins(counting_patch("probe_a"), counting_patch("probe_b"))
    originals = _originals()
    names = list(registry.available())

    def churn(seed):
        for i in range(30):
            registry.apply([names[(seed + i) % len(names)]])
            registry.revert([names[(seed + 2 * i) % len(names)]])

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    applied = registry.applied()
    for target in originals:
        chain = registry._chains.get(target)
        assert (chain is None) == (not any(target in registry.available()[n].targets for n in applied))
    registry.revert()
    _assert_restored(originals)


def test_environment_bad_value_applies_nothing(monkeypatch, caplog):
    originals = _originals()
    monkeypatch.setenv("GLM53_PATCHES", "all")
    monkeypatch.setenv("GLM53_PATCH_COMPILED_KDA_DECODE", "maybe")
    registry.from_environment()
    assert registry.applied() == []
    _assert_restored(originals)
    monkeypatch.setenv("GLM53_PATCHES_STRICT", "1")
    with pytest.raises(registry.PatchError, match="GLM53_PATCH_COMPILED_KDA_DECODE='maybe'"):
        registry.from_environment()


def test_environment_all_applies_every_exact_patch(monkeypatch):
    monkeypatch.setenv("GLM53_PATCHES", "all")
    report = registry.from_environment()
    exact = [n for n, p in registry.available().items() if registry.covered_by_all(p)]
    assert "compiled_kda_decode" in exact
    assert sorted(registry.applied()) == sorted(exact)
    assert all(report[n]["state"] == "applied" for n in exact)


def test_status_is_published_for_other_processes(monkeypatch, tmp_path):
    import json
    import os

    registry.apply(["compiled_kda_decode"])
    published = json.loads((tmp_path / "state" / f"{os.getpid()}.json").read_text())
    assert published["patches"]["compiled_kda_decode"]["state"] == "applied"
