"""The tiny checkpoint loads with stock mlx-vlm and exercises every layer kind."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_vlm import generate
from mlx_vlm.models.deepseek_v4.hyper_connection import HyperConnection
from mlx_vlm.models.glm5_next.language import (
    Glm5NextAttention,
    Glm5NextIndexer,
    Glm5NextLinearAttention,
    Glm5NextMLP,
    Glm5NextMoE,
    MoEGate,
)
from mlx_vlm.models.switch_layers import QuantizedSwitchLinear
from mlx_vlm.prompt_utils import apply_chat_template
from mlx_vlm.utils import load

from glm53_patches.tiny_model import main, write_tiny_model

STORY = (
    "Please continue this story. Once upon a time there was a village by a "
    "river, where the people made bread in the morning and told stories in the "
    "evening. The children asked questions about the stars, the weather, the "
    "animals in the forest and the boats on the water, and the old teacher "
    "answered every one of them with patience and care."
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {bits: write_tiny_model(root / f"q{bits}", quantize_bits=bits) for bits in (None, 4)}


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {bits: load(str(path)) for bits, path in checkpoints.items()}


def _layer_kind(layer):
    attn = layer.self_attn
    if isinstance(attn, Glm5NextLinearAttention):
        return "kda"
    assert isinstance(attn, Glm5NextAttention)
    return "dsa-shared" if attn.indexer is None else "dsa-full"


@pytest.mark.parametrize("bits", [None, 4])
def test_every_layer_kind_is_present(checkpoints, loaded, bits):
    model, _ = loaded[bits]
    layers = model.language_model.layers
    kinds = [_layer_kind(layer) for layer in layers]
    assert {"kda", "dsa-full", "dsa-shared"} <= set(kinds)
    # A shared-indexer layer reuses the selection of an earlier full one.
    assert kinds.index("dsa-full") < kinds.index("dsa-shared")
    mlps = {type(layer.mlp) for layer in layers}
    assert {Glm5NextMLP, Glm5NextMoE} <= mlps
    assert all(isinstance(layer.attn_hc, HyperConnection) for layer in layers)
    assert all(isinstance(layer.ffn_hc, HyperConnection) for layer in layers)
    # Internal names survive sanitize: the file holds exactly the model's tensors.
    saved = mx.load(str(checkpoints[bits] / "model.safetensors"))
    assert set(saved) == {k for k, _ in tree_flatten(model.parameters())}


def _always_fp32(path):
    return (
        "_hc." in path
        or "index_kpool_compress" in path
        or ".mlp.gate." in path  # router weight and e_score_correction_bias
    )


def test_fp32_checkpoint_is_unquantized(loaded):
    model, _ = loaded[None]
    assert not [p for p, m in model.named_modules() if hasattr(m, "scales")]
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}


def test_4bit_checkpoint_quantizes_like_convert(checkpoints, loaded):
    model, _ = loaded[4]
    config = json.loads((checkpoints[4] / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    lm = model.language_model
    modules = dict(lm.named_modules())
    assert not [p for p, m in modules.items() if type(m) is nn.Linear]
    assert isinstance(lm.lm_head, nn.QuantizedLinear)
    assert isinstance(lm.model.embed_tokens, nn.QuantizedEmbedding)
    for layer in lm.layers:
        if isinstance(layer.mlp, Glm5NextMoE):
            switch = layer.mlp.switch_mlp
            for proj in (switch.gate_proj, switch.up_proj, switch.down_proj):
                assert isinstance(proj, QuantizedSwitchLinear) and proj.bits == 4
            assert type(layer.mlp.gate) is MoEGate
        if _layer_kind(layer) == "dsa-full":
            assert isinstance(layer.self_attn.indexer.wq_b, nn.QuantizedLinear)
    kept = [(p, v) for p, v in tree_flatten(lm.parameters()) if _always_fp32(p)]
    assert any(".mlp.gate.weight" in p for p, _ in kept)
    assert all(v.dtype == mx.float32 for _, v in kept)
    # The vision tower stays full precision, as convert leaves it.
    assert not [p for p, m in model.vision_tower.named_modules() if hasattr(m, "scales")]


@pytest.mark.parametrize("bits", [None, 4])
def test_long_prompt_generation_selects_pools(loaded, monkeypatch, bits):
    model, processor = loaded[bits]
    cfg = model.config.text_config
    prompt = apply_chat_template(processor, model.config, STORY)
    n_prompt = len(processor.tokenizer.encode(prompt))
    assert n_prompt >= 80
    # More complete pools than the indexer may keep: selection must drop some.
    assert n_prompt // cfg.index_kpool > cfg.index_topk // cfg.index_kpool

    selections = []
    original = Glm5NextIndexer.__call__

    def recording(self, *args, **kwargs):
        topk = original(self, *args, **kwargs)
        selections.append(topk)
        return topk

    monkeypatch.setattr(Glm5NextIndexer, "__call__", recording)
    result = generate(model, processor, prompt, max_tokens=40, temperature=0)

    tokens = result.token_ids
    assert result.prompt_tokens == n_prompt
    assert len(tokens) == 40
    assert len(set(tokens)) > 1, tokens
    # The newest query of the last step saw the whole prompt but attended to
    # just the selected pools plus the partial tail pool.
    attended = int((selections[-1][0, -1] >= 0).sum())
    assert cfg.index_topk <= attended < cfg.index_topk + cfg.index_kpool < n_prompt


def test_logits_have_no_exact_ties(loaded):
    model, processor = loaded[None]
    ids = mx.array([processor.tokenizer.encode(STORY)])
    logits = model(ids).logits[0].astype(mx.float32)
    top2 = mx.sort(mx.topk(logits, 2, axis=-1), axis=-1)
    assert mx.all(top2[:, 1] > top2[:, 0]).item()


def test_writing_twice_gives_identical_bytes(tmp_path, checkpoints):
    for bits in (None, 4):
        again = write_tiny_model(tmp_path / f"again-q{bits}", quantize_bits=bits)
        names = sorted(p.name for p in checkpoints[bits].iterdir())
        assert names == sorted(p.name for p in again.iterdir())
        for name in names:
            assert (again / name).read_bytes() == (checkpoints[bits] / name).read_bytes(), name
    other_seed = write_tiny_model(tmp_path / "seed1", seed=1)
    weights = (other_seed / "model.safetensors").read_bytes()
    assert weights != (checkpoints[None] / "model.safetensors").read_bytes()


def test_main_writes_an_8bit_checkpoint(tmp_path, capsys):
    assert main([str(tmp_path / "m"), "--quantize-bits", "8", "--seed", "3"]) == 0
    model, _ = load(str(tmp_path / "m"))
    assert model.language_model.lm_head.bits == 8
    assert json.loads((tmp_path / "m" / "config.json").read_text())["quantization"]["bits"] == 8


def test_main_writes_a_6bit_checkpoint_and_refuses_other_widths(tmp_path):
    """6 bits: the width exact_qmv takes (GLM-5.3-Flash's DSA, shared-expert, dense and lm_head projections)."""
    assert main([str(tmp_path / "m"), "--quantize-bits", "6"]) == 0
    model, _ = load(str(tmp_path / "m"))
    assert model.language_model.lm_head.bits == 6
    assert json.loads((tmp_path / "m" / "config.json").read_text())["quantization"]["bits"] == 6
    with pytest.raises(ValueError, match=r"quantize_bits must be None or one of \(4, 6, 8\)"):
        write_tiny_model(tmp_path / "q5", quantize_bits=5)
