"""glm53-patches bench: the --small preset end to end on the CPU (no timed assertions)."""

import json
import re

import mlx.core as mx
import pytest

from glm53_patches import registry
from glm53_patches.bench import main, report, synthetic
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch

KDA_CALL = f"{GLM5_NEXT}:Glm5NextLinearAttention.__call__"
KDA_PRINTS = str(registry.available()["compiled_kda_decode"].fingerprints_path())  # verifies KDA_CALL


class _Plugin:
    def __init__(self, *patches):
        self.patches = list(patches)

    @hookimpl
    def glm53_patches(self):
        return self.patches


def _patch(name, scale=None):
    """Declared exact; with ``scale`` it is not (a planted wrong answer)."""

    def factory(inner):
        def call(self, *args, **kwargs):
            patch.stats.hit()
            out = inner(self, *args, **kwargs)
            return out if scale is None else out * scale

        return call

    patch = Patch(name=name, summary="test arm", targets={KDA_CALL: factory}, fingerprints_file=KDA_PRINTS)
    return patch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    saved = registry._extra_plugins, registry._plugins
    registry._extra_plugins, registry._plugins = [], None
    registry.register_plugin(_Plugin(_patch("bench_probe_exact"), _patch("bench_probe_wrong", scale=3.0)))
    out = tmp_path_factory.mktemp("bench") / "small.json"
    try:
        code = main(["--small", "--arms", "stock,bench_probe_exact,bench_probe_wrong", "--rounds", "2",
                     "--steps", "2", "--warmup", "1", "--check-steps", "3", "--contexts", "16,96",
                     "--prefill", "8,16", "--verify-blocks", "1,3", "--no-png", "--quiet", "--out", str(out)])
    finally:
        registry.revert()
        registry._extra_plugins, registry._plugins = saved
    return code, json.loads(out.read_text())


def test_json_has_every_figure(run):
    _, r = run
    arms = ["stock", "bench_probe_exact", "bench_probe_wrong"]
    assert list(r["arms"]) == arms
    for ctx in ("16", "96"):
        for arm in arms:
            entry = r["decode"][ctx]["arms"][arm]
            assert entry["median"] > 0 and entry["min"] <= entry["max"] and entry["ratio_vs_stock"] > 0
            assert len(entry["round_medians"]) == 2 and entry["peak_memory"] > 0
    for length in ("8", "16"):
        assert all(r["prefill"][length]["arms"][a]["tokens_per_s"] > 0 for a in arms)
        for kind, index in (("KDA", 1), ("DSA", 3)):  # one decoder layer prefilled alone
            entry = r["prefill"][f"{kind} layer {index} @{length}"]
            assert entry["length"] == int(length) and all(entry["arms"][a]["tokens_per_s"] > 0 for a in arms)
    for name in ("kda_layer", "kda_attention", "moe_block"):
        assert set(r["layers"][name]["arms"]) == set(arms)
    for name in ("dsa_layer", "dsa_attention", "dsa_indexer"):  # measured at every decode context
        for ctx in (16, 96):
            entry = r["layers"][f"{name}@{ctx}"]
            assert set(entry["arms"]) == set(arms) and entry["context"] == ctx
    rows = [name for name, _ in report.layer_entries(r)]
    assert "DSA indexer ctx 96" in rows and "DSA layer ctx 16" in rows
    graph = r["graph_primitives"]["decode_step"]
    assert all(graph[a]["total"] >= graph[a]["not_views"] > 0 for a in arms)
    assert r["bandwidth"]["copy_GBps"] > 0 and r["bandwidth"]["matvec_GBps"] > 0
    assert r["floor_ms"]["copy"] > 0 and r["bytes_per_token"]["weights"] > 0
    assert "decode.96" in r["peak_memory"] and r["peak_memory"]["after_build"] > 0
    assert r["model"]["experts"] == 8 and "same" in r["model"]["note"]


def test_decode_is_also_timed_as_mlx_vlm_pipelines_it(run):
    """Beside each synchronous decode figure: the graph-build time per step and mlx-vlm's
    async_eval loop (tok/s, ms/token, and the thread's build / async_eval / wait split)."""
    _, r = run
    for ctx in ("16", "96"):
        assert r["decode"][ctx]["pipelined_steps"] == 2
        for arm in ("stock", "bench_probe_exact", "bench_probe_wrong"):
            entry = r["decode"][ctx]["arms"][arm]
            assert 0 < entry["build_ms"]["median"] <= entry["median"]  # building is part of the step
            assert entry["build_ms"]["samples"] == entry["samples"] == 4
            piped = entry["pipelined"]
            step = piped["ms_per_token"]
            assert step["samples"] == 4 and len(step["round_medians"]) == 2 and step["min"] <= step["max"]
            assert piped["tokens_per_s"] == pytest.approx(1e3 / step["median"])
            for part in ("build_ms", "async_eval_ms", "wait_ms"):  # each a part of every token's interval
                assert 0 <= piped[part]["median"] <= step["median"] and piped[part]["samples"] == 4
            assert piped["build_ms"]["median"] > 0 and piped["ratio_vs_stock"] > 0
            assert piped["tokens_match_synchronous"]  # the same greedy tokens as the synchronous steps
        assert r["decode"][ctx]["arms"]["bench_probe_exact"]["pipelined"]["tokens_match_stock"]
        assert r["correctness"]["bench_probe_exact"][f"decode.{ctx}"]["pipelined_tokens_match"]
        assert isinstance(r["correctness"]["bench_probe_wrong"][f"decode.{ctx}"]["pipelined_tokens_match"], bool)


def test_verify_blocks_are_timed_checked_and_tabled(run):
    """Speculative verify blocks (and the 1-token step they are compared with) at every decode context,
    each arm checked bit for bit against stock, the cost of an extra token worked out per arm."""
    _, r = run
    arms = ["stock", "bench_probe_exact", "bench_probe_wrong"]
    for ctx in (16, 96):
        for block in (1, 3):
            entry = r["verify"][f"{ctx}/{block}"]
            assert (entry["context"], entry["block"]) == (ctx, block) and set(entry["arms"]) == set(arms)
            assert r["correctness"]["bench_probe_exact"][f"verify.{ctx}/{block}"]["outputs_bitwise"]
            assert not r["correctness"]["bench_probe_wrong"][f"verify.{ctx}/{block}"]["outputs_bitwise"]
    table, costs = report.verify_costs(r)
    for arm in arms:
        ms = table[96][arm]
        assert ms[3] == r["verify"]["96/3"]["arms"][arm]["median"]
        assert costs[96][arm] == pytest.approx((ms[3] - ms[1]) / (2 * ms[1]))
    lines = report.table(r).splitlines()
    title = "speculative verify blocks at a 96-token context"
    assert _column(lines, title, "L=3 ms", "bench_probe_wrong").endswith("WRONG")
    assert float(_column(lines, title, "extra token, x step", "stock")) == pytest.approx(costs[96]["stock"], abs=5e-3)
    for block in (1, 3):  # what speculation at `block` tokens a round implies: block tokens per block's ms
        rate = block * 1000 / table[96]["bench_probe_exact"][block]
        assert float(_column(lines, title, f"tok/s, {block} a round", "bench_probe_exact")) == pytest.approx(rate, rel=0.01)
    build = r["verify"]["96/3"]["arms"]["stock"]["build_ms"]  # the graph's build, part of the block's time
    assert 0 < build["median"] < r["verify"]["96/3"]["arms"]["stock"]["median"]
    assert float(_column(lines, title, "L=3 build", "stock")) == pytest.approx(build["median"], rel=0.05, abs=0.05)


def _column(lines, title, header, arm):
    """The cell under ``header`` in ``arm``'s row of the table block that starts with ``title``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    head = next(i for i in range(start, len(lines))
                if lines[i].startswith("arm ") and header in re.split(r"\s{2,}", lines[i]))
    row = next(line for line in lines[head:] if line.startswith(arm + " "))
    at = re.search(rf"(?<=  ){re.escape(header)}(  |$)", lines[head]).start()
    return re.split(r"\s{2,}", row[at:])[0]


def test_table_fits_120_columns_with_arms_as_rows(run):
    _, r = run
    text = report.table(r)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    for ctx in ("16", "96"):
        title = f"decode at a {ctx}-token context"
        for arm in r["arms"]:
            piped = r["decode"][ctx]["arms"][arm]["pipelined"]
            assert float(_column(lines, title, "tok/s", arm)) == pytest.approx(piped["tokens_per_s"], rel=2e-3)
            assert float(_column(lines, title, "build", arm)) == pytest.approx(piped["build_ms"]["median"], rel=2e-3)
            sync = _column(lines, title, "ms/token", arm)
            assert float(sync.split()[0]) == pytest.approx(r["decode"][ctx]["arms"][arm]["median"], rel=2e-3)
        assert _column(lines, title, "ms/token", "bench_probe_wrong").endswith("WRONG")
        for header in ("pipelined ms/token", "async_eval", "wait"):
            assert _column(lines, title, header, "stock")
    assert _column(lines, "check vs stock", "verdict", "bench_probe_exact").startswith("ok")


@pytest.mark.filterwarnings("error::UserWarning")  # matplotlib's "Tight layout not applied": overprinted panels
def test_from_json_honours_out(run, tmp_path):
    _, r = run
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(r))
    out = tmp_path / "elsewhere" / "again.json"
    assert main(["--from-json", str(saved), "--out", str(out)]) == 0
    assert (tmp_path / "elsewhere" / "again.png").stat().st_size > 0 and not (tmp_path / "saved.png").exists()
    assert json.loads(out.read_text())["decode"] == r["decode"]
    assert main(["--from-json", str(saved)]) == 0  # without --out: beside the saved run, as before
    assert (tmp_path / "saved.png").exists()


def test_graph_count_is_deterministic(run):
    _, r = run
    graph = r["graph_primitives"]["decode_step"]
    assert graph["stock"] == graph["bench_probe_exact"]  # a pass-through wrapper adds no primitive


def test_token_check_compares_arms(run):
    code, r = run
    good = r["correctness"]["bench_probe_exact"]
    assert set(good) >= {"decode.16", "decode.96", "layers.kda_layer", "layers.dsa_indexer@96", "prefill.8"}
    for name in ("decode.16", "decode.96"):
        check = good[name]
        assert check["compared_with"] == "stock" and len(check["tokens"]) == 3
        assert check["tokens"] == check["stock_tokens"] and check["tokens_match"]
        assert check["outputs_bitwise"] and check["final_state_bitwise"] and check["timed_tokens_match"]
    assert r["verdicts"]["bench_probe_exact"].startswith("ok")
    wrong = r["correctness"]["bench_probe_wrong"]["decode.96"]
    assert not wrong["outputs_bitwise"] and wrong["max_abs_diff"] > 0
    assert good["prefill.KDA layer 1 @16"]["final_state_bitwise"]  # the KDA state is compared too
    assert not r["correctness"]["bench_probe_wrong"]["prefill.KDA layer 1 @16"]["outputs_bitwise"]
    assert r["correctness"]["bench_probe_wrong"]["prefill.8"]["tokens_match"] is not None
    assert r["verdicts"]["bench_probe_wrong"].startswith("WRONG")
    assert not report.is_valid(r, "bench_probe_wrong") and code == 1
    assert "WRONG" in report.table(r)


def _expected_decode_bytes(c, act, scale):
    """Independent count from the config: what one decode token reads."""

    def q(rows, cols, bits):
        return rows * cols * bits / 8 + 2 * rows * (cols // 64) * scale

    h, nh, hd = c.hidden_size, c.linear_num_heads, c.linear_head_dim
    p, mix = nh * hd, (2 + c.hc_mult) * c.hc_mult
    total = q(1, h, 6) + q(c.vocab_size, h, 6) + h * act  # one embedding row, lm_head, final norm
    for i in range(c.num_hidden_layers):
        total += 2 * h * act + 2 * (mix * c.hc_mult * h + mix + 3) * 4  # norms, two HCs (fp32)
        if c.layer_types[i] == "linear_attention":
            total += q(3 * p, h, 8) + q(2 * hd + nh, h, 8) + 2 * q(p, hd, 8) + q(h, p, 8)
            total += 3 * p * c.linear_conv_kernel_dim * act + nh * 4 + p * 4 + hd * act
        else:
            n, ql, kv = c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
            total += q(ql + kv, h, 6) + ql * act + q(n * c.qk_nope_head_dim, ql, 6) + kv * act
            total += n * q(kv, c.qk_nope_head_dim, 6) + n * q(c.v_head_dim, kv, 6) + q(h, n * c.v_head_dim, 6)
            if c.indexer_types[i] == "full":
                ih, idim = c.index_n_heads, c.index_head_dim
                total += q(ih * idim, ql, 6) + q(idim, h, 6) + 2 * idim * act + q(ih, h, 6)
                total += c.index_kpool * idim * 4 + idim * h * 4
        if c.mlp_layer_types[i] == "dense":
            total += q(2 * c.intermediate_size, h, 6) + q(h, c.intermediate_size, 6)
        else:
            e, im = c.n_routed_experts, c.moe_intermediate_size
            total += e * h * 4 + e * 4  # router and score bias, fp32
            total += c.num_experts_per_tok * (2 * q(im, h, 4) + q(h, im, 4))
            total += q(2 * im * c.n_shared_experts, h, 6) + q(h, im * c.n_shared_experts, 6)
    return total


def test_bytes_per_token_matches_an_independent_count(run):
    _, r = run
    config = synthetic.text_config("small")
    assert r["bytes_per_token"]["weights"] == pytest.approx(_expected_decode_bytes(config, 4, 4))
    model = synthetic.build(config, dtype=mx.bfloat16)  # bf16 scales and norms: 2 bytes
    assert synthetic.decode_bytes(model, config)["total"] == pytest.approx(_expected_decode_bytes(config, 2, 2))


def test_the_synthetic_model_is_in_eval_mode_as_a_loaded_one():
    """mlx-vlm's load_model calls eval() after quantizing; the Quantized* modules nn.quantize makes start
    in training mode, and stock's ``linear`` then sends a verify block through ``module(x)`` instead of
    the singleton path a server takes (s31-s33's block figures ran that way)."""
    config = synthetic.text_config("small")
    model = synthetic.build(config, dtype=mx.float32)
    assert [name for name, module in model.named_modules() if module.training] == []


def test_context_caches_match_a_real_prefill():
    """The synthetic context has the shapes and dtypes a real prefill leaves
    (except the prefill-only projected MLA cache, which decode never reads)."""
    config = synthetic.text_config("small")
    model = synthetic.build(config, dtype=mx.bfloat16)
    made = synthetic.context_caches(model, 96, mx.bfloat16)
    real = model.make_cache()
    mx.eval(model(mx.arange(96)[None] % config.vocab_size, cache=real).logits)
    for layer, a, b in zip(model.model.layers, made, real):
        if not layer.is_linear:
            b = type(b)(*b.caches[:-1])  # drop the projected cache
            assert a.caches[0].offset == b.caches[0].offset == 96
            assert a.caches[2].offset == b.caches[2].offset and a.caches[2].remainder == b.caches[2].remainder
        shape = lambda x: (x.shape[:2] + x.shape[3:]) if x.ndim == 4 else x.shape  # noqa: E731
        assert [(shape(x), x.dtype) for x in synthetic.cache_arrays(a)] == \
               [(shape(x), x.dtype) for x in synthetic.cache_arrays(b)]


def test_numerics_changing_arm_is_reported_with_its_ratio_unless_tokens_differ():
    def results(tokens_match):
        check = {"outputs_bitwise": False, "final_state_bitwise": False, "max_abs_diff": 1e-3,
                 "tokens_match": tokens_match}
        return {"arms": {"stock": {}, "fast": {"numerics": "changing", "patches": ["x"], "applied": True}},
                "correctness": {"fast": {"decode.16": check}}}

    same, differ = results(True), results(False)
    for r in (same, differ):
        r["verdicts"] = report.verdicts(r)
    assert same["verdicts"]["fast"].endswith("same greedy tokens") and report.is_valid(same, "fast")
    assert "differ in decode.16" in differ["verdicts"]["fast"] and not report.is_valid(differ, "fast")


def test_an_exact_arm_whose_pipelined_tokens_differ_is_wrong():
    check = {"outputs_bitwise": True, "final_state_bitwise": True, "max_abs_diff": 0.0, "tokens_match": True,
             "timed_tokens_match": True, "pipelined_tokens_match": False}
    r = {"arms": {"stock": {}, "fast": {"numerics": "exact", "patches": ["x"], "applied": True,
                                        "counters": {"x.hits.call": 1}}},
         "correctness": {"fast": {"decode.16": check}}}
    assert report.verdicts(r)["fast"] == "WRONG: differs from stock in decode.16"
    check["pipelined_tokens_match"] = True
    assert report.verdicts(r)["fast"] == "ok (bit-identical)"


def test_all_arm_is_what_glm53_patches_all_turns_on():
    from glm53_patches.bench import measure

    arms = measure.Arms("stock,all,all+kda_prefill_kernel", lambda message: None)
    try:
        everything = registry.available()
        expected = [n for n, p in everything.items() if registry.covered_by_all(p)]
        assert arms.sets["all"] == expected and "kda_prefill_kernel" not in expected
        assert arms.sets["all+kda_prefill_kernel"] == expected + ["kda_prefill_kernel"]
        assert any(everything[n].numerics == "changing" for n in everything)  # there is something to exclude
    finally:
        arms.close()


def test_prefill_check_on_a_short_prompt_runs_once(tmp_path):
    """--prefill-check-tokens: longer prompts are checked on their first N tokens, once,
    and the check still catches a wrong arm; the cold pass's seconds are recorded."""
    saved = registry._extra_plugins, registry._plugins
    registry._extra_plugins, registry._plugins = [], None
    registry.register_plugin(_Plugin(_patch("bench_probe_wrong", scale=3.0)))
    out = tmp_path / "short.json"
    try:
        main(["--small", "--arms", "stock,bench_probe_wrong", "--sections", "prefill", "--prefill", "8,12,16",
              "--prefill-check-tokens", "8", "--prefill-rounds", "1", "--no-png", "--quiet", "--out", str(out)])
    finally:
        registry.revert()
        registry._extra_plugins, registry._plugins = saved
    r = json.loads(out.read_text())
    checks = r["correctness"]["bench_probe_wrong"]
    assert set(checks) == {"prefill.8", "prefill.model first 8 tokens"}  # 8 whole; 12 and 16 share one
    assert not checks["prefill.model first 8 tokens"]["outputs_bitwise"]
    assert checks["prefill.model first 8 tokens"]["stock_seconds"] > 0
    assert r["prefill"]["12"]["check"] and r["prefill"]["16"]["check"] == {}
    assert all(r["prefill"][n]["arms"]["bench_probe_wrong"]["tokens_per_s"] > 0 for n in ("8", "12", "16"))


def test_prefill_untimed_stock_is_only_the_checks_reference(tmp_path, capsys):
    """--prefill-untimed-stock: stock still decides the check, is not timed, and the
    other arms' ratios are against the first of them (table and PNG still drawn)."""
    saved = registry._extra_plugins, registry._plugins
    registry._extra_plugins, registry._plugins = [], None
    registry.register_plugin(_Plugin(_patch("bench_probe_exact"), _patch("bench_probe_also_exact"),
                                     _patch("bench_probe_wrong", scale=3.0)))
    out = tmp_path / "untimed.json"
    try:
        main(["--small", "--arms", "stock,bench_probe_exact,bench_probe_also_exact,bench_probe_wrong", "--sections", "prefill",
              "--prefill", "12", "--prefill-check-tokens", "8", "--prefill-rounds", "2", "--prefill-untimed-stock",
              "--quiet", "--out", str(out)])
    finally:
        registry.revert()
        registry._extra_plugins, registry._plugins = saved
    r = json.loads(out.read_text())
    entry = r["prefill"]["12"]
    assert list(entry["arms"]) == ["bench_probe_exact", "bench_probe_also_exact", "bench_probe_wrong"]
    assert entry["ratio_base"] == "bench_probe_exact"
    assert entry["arms"]["bench_probe_exact"]["ratio_vs_first_arm"] == 1.0
    assert entry["arms"]["bench_probe_wrong"]["ratio_vs_first_arm"] > 0 and entry["rounds"] == 2
    assert entry["check"]["bench_probe_exact"]["outputs_bitwise"]
    assert not entry["check"]["bench_probe_wrong"]["outputs_bitwise"]
    lines = capsys.readouterr().out.splitlines()
    cells = {arm: _column(lines, "prefill, tokens/s", "12", arm) for arm in r["arms"]}
    assert cells["stock"] == "untimed" and cells["bench_probe_exact"].endswith("]")
    assert cells["bench_probe_also_exact"].endswith("x vs first") and cells["bench_probe_wrong"].endswith("WRONG")
    assert (tmp_path / "untimed.png").exists()


def test_prefill_untimed_stock_alone_is_refused(capsys):
    assert main(["--small", "--arms", "stock", "--sections", "prefill", "--prefill-untimed-stock", "--quiet"]) == 2
    assert "--prefill-untimed-stock needs an arm besides stock" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from glm53_patches.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("checkpoint") / "tiny-glm", quantize_bits=4)


def test_model_runs_the_users_checkpoint_and_writes_a_report(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """--model DIR: the checkpoint loaded as mlx-vlm loads it, stock vs patched interleaved
    with the check; --report is a Markdown file with the machine, versions, arms, figures."""
    import importlib.metadata
    import platform

    from mlx_vlm.utils import load_model

    saved = registry._extra_plugins, registry._plugins
    registry._extra_plugins, registry._plugins = [], None
    registry.register_plugin(_Plugin(_patch("bench_probe_exact"), _patch("bench_probe_wrong", scale=3.0)))
    out, shared = tmp_path / "mine.json", tmp_path / "share" / "report.md"
    monkeypatch.setenv("HOME", str(tiny_checkpoint.parent))  # the report names no home folder
    try:
        code = main(["--model", str(tiny_checkpoint), "--arms", "stock,bench_probe_exact,bench_probe_wrong",
                     "--sections", "decode,prefill", "--contexts", "16", "--prefill", "8", "--rounds", "2",
                     "--steps", "2", "--warmup", "1", "--check-steps", "2", "--no-png", "--quiet",
                     "--out", str(out), "--report", str(shared)])
    finally:
        registry.revert()
        registry._extra_plugins, registry._plugins = saved
    r = json.loads(out.read_text())
    assert code == 1 and r["verdicts"]["bench_probe_wrong"].startswith("WRONG")
    assert r["verdicts"]["bench_probe_exact"].startswith("ok")
    assert r["model"]["preset"] == "checkpoint" and r["model"]["checkpoint"] == "tiny-glm"
    assert (r["model"]["layers"], r["model"]["experts"], r["model"]["dtype"]) == (8, 8, "float32")
    assert r["model"]["quantization"]["bits"] == 4
    for arm in ("stock", "bench_probe_exact"):
        entry = r["decode"]["16"]["arms"][arm]
        assert entry["median"] > 0 and entry["pipelined"]["tokens_per_s"] > 0
        assert r["prefill"]["8"]["arms"][arm]["tokens_per_s"] > 0
    # the bench prefilled the checkpoint's own weights: stock's token is the one a separate load gives
    model = load_model(tiny_checkpoint).language_model
    prompt = mx.random.randint(0, model.config.vocab_size, (1, 8), key=mx.random.key(8))
    expected = mx.argmax(model(prompt, cache=model.make_cache()).logits[:, -1], axis=-1).item()
    assert r["correctness"]["bench_probe_exact"]["prefill.8"]["stock_tokens"] == [expected]
    printed = capsys.readouterr().out
    assert "pipelined ms/token" in printed and f"wrote {shared}" in printed
    text = shared.read_text()
    for fact in (platform.platform(), platform.python_version(), importlib.metadata.version("mlx"),
                 importlib.metadata.version("mlx-vlm"), "`tiny-glm`", "bench_probe_exact", "bench_probe_wrong",
                 r["verdicts"]["bench_probe_wrong"], "pipelined ms/token"):
        assert fact in text
    assert "--model ~/tiny-glm " in text and str(tiny_checkpoint.parent) not in text
    data = json.loads(text.split("```json\n")[1].split("```")[0])
    assert data["arms"]["bench_probe_wrong"]["verdict"].startswith("WRONG")
    assert all(data["checks_passed"]["bench_probe_exact"].values())
    assert not all(data["checks_passed"]["bench_probe_wrong"].values())
    assert data["decode"]["16"]["stock"]["pipelined"]["tokens_per_s"] > 0
    assert data["prefill"]["8"]["bench_probe_exact"]["tokens_per_s"] > 0


def _write(folder, config):
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such folder"),
    ("empty", "no config.json"),
    ("garbled", "config.json is unreadable"),
    ("llama", "model_type is 'llama', not 'glm5_next'"),
    ("no weights", "no *.safetensors weights in it"),
    ("broken weights", "mlx-vlm could not load it"),
])
def test_a_bad_model_folder_is_one_line(case, expected, tmp_path, capsys):
    folder = tmp_path / case
    if case == "empty":
        _write(folder, None)
    elif case == "garbled":
        _write(folder, "{not json")
    elif case == "llama":
        _write(folder, json.dumps({"model_type": "llama"}))
    elif case in ("no weights", "broken weights"):
        from glm53_patches.tiny_model import tiny_config

        _write(folder, json.dumps(tiny_config()))
        if case == "broken weights":
            (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    assert main(["--model", str(folder), "--sections", "decode", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"glm53-patches bench: --model {folder}: {expected}")
    assert "Traceback" not in err and not (tmp_path / "x.json").exists()
    if case != "broken weights":  # refused before anything runs; a load that fails follows its progress line
        assert err.count("\n") == 1


def test_model_with_synthetic_options_is_refused(tiny_checkpoint, capsys):
    assert main(["--model", str(tiny_checkpoint), "--small", "--layers", "4"]) == 2
    assert capsys.readouterr().err == "glm53-patches bench: --model DIR runs the checkpoint as it is: drop --small, --layers\n"
