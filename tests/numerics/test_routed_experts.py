"""routed_experts on the CPU: the wrapper steps aside, and routes exactly the expert projections stock runs
as MLX's qmm_sm80 on CUDA.

The patch is one CUDA kernel behind ``QuantizedSwitchLinear.__call__`` and,
for a decode step's up and gate in one launch, ``SwitchGLU.__call__``, taken
only inside a glm5_next MoE block (its ``MoE.__call__`` wrapper marks them).
``glm53-patches verify routed_experts`` runs it against ``gather_qmm`` on a
GPU; ``benchmarks/h200/probe_expert_mma.py`` found it bit-identical on an H100.
There is no GPU here, so:

* what the CPU user gets: stock, bit for bit, in decode and verify blocks,
  each MoE block counted once as "no CUDA" and its projections not offered;
  revert of both targets, also stacked on expert_combine; ``verify`` says it
  steps aside;
* the coverage rules (``experts.unsupported``, ``routes_per_row``) on real
  ``QuantizedSwitchLinear`` modules, and that another model's calls are not
  taken or counted;
* with CUDA pretended and the kernel replaced by a recorder that runs stock's
  ``gather_qmm`` on what it is handed (each route's input row found as the
  kernel finds it): decode and verify blocks stay bit for bit, alone, under
  expert_combine (which calls the experts itself) and traced by layer_decode,
  so the wrapper hands over each module's arrays, the routes in order and the
  right input row per route, and shapes the result as stock does.

The tiny model here has a hidden size of 512, experts 256 wide and top-8 of
16, served in bf16: the shapes qmm_sm80 and the kernel (K a multiple of 256)
take.

The Metal twin (a decode step's SwitchGLU: gate and up in one dispatch, then
down) is emulated against stock's Metal kernel in ``tests/metal``. Here, with
Metal pretended and the twin answered by stock's ``gather_qmm``, on a tiny
model with experts 512 wide (gather_qmv_fast's K): the coverage rules, decode
and verify blocks bit for bit (also under expert_combine and layer_decode),
what the twin is handed, that reversed routes change the logits, and verify's
Metal op cases through the wrapper.
"""

import mlx.core as mx
import pytest
from mlx_vlm.models.switch_layers import MoE, QuantizedSwitchLinear, SwitchGLU

import glm53_patches
from glm53_patches.patches import routed_experts
from glm53_patches.patches.routed_experts import experts, kernel
from glm53_patches.tiny_model import build_model, greedy_logits, speculative_outputs
from test_exact_qmv import assert_bitwise  # the same bit-for-bit list comparison

NAME = "routed_experts"
PROMPT = mx.array([[(5 * i + 2) % 500 for i in range(24)]])


def counts():
    snapshot = routed_experts.PATCH.stats.snapshot()
    return snapshot["hits"], snapshot["fallbacks"]


def outputs(model):
    """Greedy decode at batch 1 and 2, then the verify blocks: every logit and the caches after them."""
    batch = mx.concatenate([PROMPT, PROMPT[:, ::-1]])
    return greedy_logits(model, PROMPT, 4) + greedy_logits(model, batch, 3) + speculative_outputs(model, PROMPT)


def tiny_language_model(expert_width, seed):
    """The tiny model, 4-bit, served in bf16, hidden size 512, ``expert_width``-wide experts, top-8 of 16."""
    from glm53_patches.exactness import _served_dtype
    from glm53_patches.tiny_model import gpu_widths

    config = {**gpu_widths(), "hidden_size": 512, "moe_intermediate_size": expert_width, "n_routed_experts": 16,
              "num_experts_per_tok": 8}
    return _served_dtype(build_model(seed=seed, quantize_bits=4, **config), mx.bfloat16).language_model


@pytest.fixture(scope="module")
def model():
    return tiny_language_model(256, seed=2)


@pytest.fixture(scope="module")
def stock_outputs(model):
    glm53_patches.disable()
    return outputs(model)


@pytest.fixture
def applied():
    glm53_patches.disable()
    routed_experts.PATCH.stats.reset()
    glm53_patches.enable([NAME], strict=True)
    yield
    glm53_patches.disable()


def switch_linear(n=256, k=512, bits=4, group=64, dtype=mx.bfloat16, bias=False):
    module = QuantizedSwitchLinear(k, n, 16, bias=bias, group_size=group, bits=bits)
    module.set_dtype(dtype)
    return module


def test_on_the_cpu_stock_runs_bit_for_bit(model, stock_outputs, applied):
    assert_bitwise(stock_outputs, outputs(model), "decode and verify blocks, routed_experts applied on the CPU")
    hits, fallbacks = counts()
    assert not hits
    assert set(fallbacks) == {"no CUDA or Metal"} and fallbacks["no CUDA or Metal"] >= 7 * 20  # 7 MoE layers, 20+ calls


def test_revert_restores_the_original_objects():
    """Alone, and stacked on expert_combine (which wraps MoE.__call__ too)."""
    glm53_patches.disable()
    owners = (MoE, QuantizedSwitchLinear, SwitchGLU)
    originals = tuple(owner.__dict__["__call__"] for owner in owners)
    for names in ([NAME], ["expert_combine", NAME]):
        glm53_patches.enable(names)
        try:
            assert all(owner.__dict__["__call__"] is not original for owner, original in zip(owners, originals))
        finally:
            glm53_patches.disable()
        assert tuple(owner.__dict__["__call__"] for owner in owners) == originals


def test_routes_per_row():
    assert experts.routes_per_row((1, 1, 1), (1, 1, 8)) == 8  # decode: one input for the token's 8 routes
    assert experts.routes_per_row((1, 1, 8), (1, 1, 8)) == 1  # the down projection: one input per route
    assert experts.routes_per_row((1, 4, 1), (1, 4, 8)) == 8  # a verify block: one input per position
    assert experts.routes_per_row((2, 1, 1), (2, 1, 8)) == 8
    assert experts.routes_per_row((1, 1), (1, 4, 8)) == 32  # fewer dims: broadcast on the left
    assert experts.routes_per_row((1, 4, 1), (2, 4, 8)) is None  # positions repeat for each batch row
    assert experts.routes_per_row((1, 1, 8), (1, 4, 8)) is None  # the same 8 inputs for every position


def test_coverage():
    x, idx = mx.zeros((1, 1, 1, 1, 512), mx.bfloat16), mx.zeros((1, 1, 8), mx.uint32)
    assert experts.unsupported(switch_linear(), x, idx, False) is None
    block = mx.zeros((1, 7, 1, 1, 512), mx.bfloat16), mx.zeros((1, 7, 8), mx.uint32)
    assert experts.unsupported(switch_linear(), *block, False) is None
    down = mx.zeros((1, 1, 8, 1, 512), mx.bfloat16)
    assert experts.unsupported(switch_linear(), down, idx, False) is None
    assert experts.unsupported(switch_linear(), x, mx.zeros((1, 1, 7), mx.uint32), False) == "routes"  # gather_qmv
    assert experts.unsupported(switch_linear(), x, idx, True) == "sorted"
    assert experts.unsupported(switch_linear(), mx.zeros((1, 1, 1, 2, 512), mx.bfloat16), idx, False) == "rows"
    assert experts.unsupported(switch_linear(), x.astype(mx.float16), idx, False) == "dtype"
    assert experts.unsupported(switch_linear(dtype=mx.float32), x.astype(mx.float32), idx, False) == "dtype"
    assert experts.unsupported(switch_linear(bits=8), x, idx, False) == "quantization"
    assert experts.unsupported(switch_linear(group=128), x, idx, False) == "quantization"
    assert experts.unsupported(switch_linear(bias=True), x, idx, False) == "bias"
    assert experts.unsupported(switch_linear(n=192), x, idx, False) == "shape"  # qmm_sm80 wants N % 128 == 0
    assert experts.unsupported(switch_linear(k=768), mx.zeros((1, 1, 1, 1, 768), mx.bfloat16), idx, False) is None
    assert experts.unsupported(switch_linear(), mx.zeros((1, 1, 1, 1, 256), mx.bfloat16), idx, False) == "shape"
    # K a multiple of 64 (qmm_sm80 takes it) but not of the kernel's step of 256, or past its shared memory
    assert experts.unsupported(switch_linear(k=576), mx.zeros((1, 1, 1, 1, 576), mx.bfloat16), idx, False) == "shape"
    wide = kernel.MAX_K + kernel.STEP
    assert experts.unsupported(switch_linear(k=wide), mx.zeros((1, 1, 1, 1, wide), mx.bfloat16), idx, False) == "shape"
    odd = mx.zeros((1, 4, 1, 1, 512), mx.bfloat16), mx.zeros((2, 4, 8), mx.uint32)
    assert experts.unsupported(switch_linear(), *odd, False) == "broadcast"
    # more inputs than indices: the batch comes from the input, which the kernel's one index per route can't take
    few = mx.zeros((1, 8, 1, 512), mx.bfloat16), mx.zeros((1,), mx.uint32)
    assert experts.unsupported(switch_linear(), *few, False) == "broadcast"


def test_off_cuda_a_block_is_counted_once_and_its_projections_not_offered(model, applied):
    mx.eval(model(PROMPT[:, :1], cache=model.make_cache()).logits)
    assert counts() == ({}, {"no CUDA or Metal": 7})  # the 7 MoE layers, not their 21 projections


def test_only_glm5_next_moe_calls_are_taken(applied):
    """A QuantizedSwitchLinear called outside a Glm5NextMoE (another model's) goes to stock uncounted."""
    module, x, idx = switch_linear(), mx.zeros((1, 1, 1, 1, 512), mx.bfloat16), mx.zeros((1, 1, 8), mx.uint32)
    assert experts.project(module, x, idx, False) is None
    assert counts() == ({}, {})
    experts._inside.depth = 1
    try:
        assert experts.project(module, x, idx, False) is None
    finally:
        experts._inside.depth = 0
    assert counts() == ({}, {"no CUDA": 1})  # marked, as a CPU never is: the CUDA wrapper's own count


def stock_expert_mma(x, idx, projections, **settings):
    """Stands in for ``kernel.expert_mma`` (whose settings change no bit): stock's ``gather_qmm`` for each
    projection over the routes, each route's input row found as the kernel finds it (``r // (R / X)``)."""
    return stock_expert_qmv(x, idx, projections, 4, 64)


def run_pretending(monkeypatch, model, names, backend="cuda", stand_in=None, run=outputs):
    """``run(model)`` (default ``outputs``) with ``names`` applied (their counters reset) and routed_experts'
    kernel forced on, ``backend`` pretended; the kernel (CUDA's ``expert_mma`` or Metal's ``expert_qmv``)
    records the shapes it is handed and answers with ``stand_in`` (default: stock's ``gather_qmm``).
    Returns the outputs and the record."""
    from glm53_patches import registry

    name, stand_in = (("expert_mma", stand_in or stock_expert_mma) if backend == "cuda" else
                      ("expert_qmv", stand_in or stock_expert_qmv))
    seen = []

    def recorder(x, idx, projections, *args, **kwargs):  # (routes, input rows, projections, K, N)
        seen.append((idx.shape[0], x.shape[0], len(projections), x.shape[1], projections[0][0].shape[1]))
        return stand_in(x, idx, projections, *args, **kwargs)

    monkeypatch.setattr(experts, "gpu_backend", lambda: backend)
    monkeypatch.setattr(kernel, name, recorder)
    for patch in names:
        registry.available()[patch].stats.reset()
    glm53_patches.enable(names, strict=True)
    try:
        with experts.switch.forcing(True):
            return run(model), seen
    finally:
        glm53_patches.disable()


def test_where_the_kernel_runs_it_gets_stocks_arguments(monkeypatch, model, stock_outputs):
    actual, seen = run_pretending(monkeypatch, model, [NAME])
    assert_bitwise(stock_outputs, actual, "decode and verify blocks, the kernel's calls answered by gather_qmm")
    # decode at batch 1 and 2: gate and up of one input per token in one launch, then down of an input per route
    decode = {(8, 1, 2, 512, 256), (8, 8, 1, 256, 512), (16, 2, 2, 512, 256), (16, 16, 1, 256, 512)}
    # verify blocks of 2 to 8 positions: gate, up (an input per position) and down (an input per route) apart
    blocks = {kind for n in range(2, 9) for kind in ((8 * n, n, 1, 512, 256), (8 * n, 8 * n, 1, 256, 512))}
    assert set(seen) == decode | blocks
    hits, fallbacks = counts()
    assert hits["kernel"] == len(seen)
    assert set(fallbacks) == {"sorted"}  # the prompt's prefill: 24 x 8 routes, which stock sorts first


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_under_expert_combine_and_layer_decode(request, monkeypatch, backend):
    """expert_combine's MoE.__call__ calls the experts itself (its kernel pretended with stock's combine):
    the marking wrapper must be outside it. layer_decode traces the MoE layers with the kernel (CUDA) or
    the twin (Metal) inside."""
    from glm53_patches.patches import expert_combine, layer_decode
    from glm53_patches.patches.expert_combine import combine

    prefix = "" if backend == "cuda" else "metal_"
    model, stock = request.getfixturevalue(prefix + "model"), request.getfixturevalue(prefix + "stock_outputs")
    monkeypatch.setattr(combine, "gpu_backend", lambda: backend)
    monkeypatch.setattr(combine, "unsupported", lambda *args: None)
    monkeypatch.setattr(combine, "expert_combine", lambda routed, weights, shared: SwitchGLU._combine(
        routed, weights, shared))
    with combine.switch.forcing(True):
        actual, seen = run_pretending(monkeypatch, model, ["expert_combine", NAME, "layer_decode"], backend)
    assert_bitwise(stock, actual, f"routed_experts on {backend} under expert_combine and layer_decode")
    hits = counts()[0]
    assert seen and (hits["kernel"] == len(seen) if backend == "cuda" else hits["metal twin"] == len(seen) // 2)
    assert expert_combine.PATCH.stats.snapshot()["hits"]
    assert layer_decode.PATCH.stats.snapshot()["hits"]


def test_verify_on_the_cpu_says_it_steps_aside():
    from glm53_patches.patches.routed_experts.checks.verify import verify

    result = verify()
    assert result["exact"] and result["cases"] >= 4
    assert "steps aside" in result["detail"]


def test_verifys_op_check_runs_through_the_wrapper(monkeypatch):
    """verify's CUDA-only op cases, at small widths, CUDA pretended and the kernel answered by gather_qmm:
    every call form is taken by the wrapper and every setting reaches the kernel; a kernel that gets a
    route wrong is reported as differing."""
    from glm53_patches.exactness import Tally
    from glm53_patches.patches.routed_experts.checks import verify

    monkeypatch.setattr(verify, "SHAPES", [("gate/up", 256, 512), ("down", 512, 256)])
    monkeypatch.setattr(verify, "GLU_CALLS", [(label, 512, 256, *rest) for label, _, _, *rest in verify.GLU_CALLS])
    monkeypatch.setattr(verify, "EXPERTS", 16)
    monkeypatch.setattr(experts, "gpu_backend", lambda: "cuda")
    calls = []
    monkeypatch.setattr(kernel, "expert_mma", lambda x, idx, projections, **settings: calls.append(
        (len(projections), settings)) or stock_expert_mma(x, idx, projections))
    tally = Tally()
    verify.check_op(tally)
    result = tally.result(0.1)
    assert result["exact"], result["detail"]
    assert result["cases"] == 2 * (len(verify.CALLS) + len(verify.SETTINGS)) + len(verify.PAIR_SETTINGS) + len(
        verify.GLU_CALLS)
    # the settings reach the kernel, and the pairs and decode steps take two projections in one launch
    assert {(1, str(s)) for s in verify.SETTINGS} | {(2, str(s)) for s in verify.PAIR_SETTINGS} <= {
        (p, str(s)) for p, s in calls}
    assert sum(p == 2 and not s for p, s in calls) == 1 + len(verify.GLU_CALLS)
    monkeypatch.setattr(kernel, "expert_mma", lambda x, idx, *a, **kw: stock_expert_mma(x, idx[::-1], *a))
    wrong = Tally()
    verify.check_op(wrong)
    assert not wrong.result(0.1)["exact"]
    assert len(wrong.mismatches) == result["cases"]


def test_on_cuda_a_decode_step_takes_gate_and_up_together_only_where_both_take_the_kernel(monkeypatch):
    monkeypatch.setattr(kernel, "expert_mma", stock_expert_mma)
    x, idx = mx.zeros((1, 1, 512), mx.bfloat16), mx.zeros((1, 1, 8), mx.uint32)
    taken = experts.cuda_decode(switch_glu(), x, idx)
    assert taken is not None and taken.shape == (1, 1, 8, 512)  # stock's routed outputs before _combine
    seven = mx.zeros((7, 1, 512), mx.bfloat16), mx.zeros((7, 1, 8), mx.uint32)
    assert experts.cuda_decode(switch_glu(), *seven) is not None  # 56 routes, unsorted
    block = mx.zeros((1, 4, 512), mx.bfloat16), mx.zeros((1, 4, 8), mx.uint32)
    assert experts.cuda_decode(switch_glu(), *block) is None  # stock's block path calls the projections
    eight = mx.zeros((8, 1, 512), mx.bfloat16), mx.zeros((8, 1, 8), mx.uint32)
    assert experts.cuda_decode(switch_glu(), *eight) is None  # 64 routes: stock sorts them
    assert experts.cuda_decode(switch_glu(bits=8), x, idx) is None  # not qmm_sm80's 4-bit arithmetic
    assert experts.cuda_decode(switch_glu(), x.astype(mx.float16), idx) is None
    odd = switch_glu()
    odd.up_proj = switch_linear(384, 512)
    assert experts.cuda_decode(odd, x, idx) is None  # one launch takes projections of one shape
    training = switch_glu()
    training.train()
    assert experts.cuda_decode(training, x, idx) is None
    assert experts.cuda_decode(SwitchGLU(512, 512, 16), x, idx) is None  # not quantized


@pytest.mark.parametrize("fault", ["routes reversed", "up and gate swapped"])
def test_on_cuda_a_wrong_gate_and_up_launch_changes_the_outputs(monkeypatch, model, fault):
    """The model comparison can fail where a decode step's gate and up share a launch (CUDA pretended): that
    launch answered with the routes reversed, or its two outputs swapped, gives other logits."""
    steps = lambda model: greedy_logits(model, PROMPT, 2)  # noqa: E731
    glm53_patches.disable()
    stock = steps(model)

    def faulty(x, idx, projections, **settings):
        if len(projections) == 1:
            return stock_expert_mma(x, idx, projections)
        if fault == "routes reversed":
            return stock_expert_mma(x, idx[::-1], projections)
        return stock_expert_mma(x, idx, projections)[::-1]

    wrong, seen = run_pretending(monkeypatch, model, [NAME], "cuda", faulty, run=steps)
    assert any(projections == 2 for _, _, projections, *_ in seen)
    with pytest.raises(AssertionError):
        assert_bitwise(stock, wrong, fault)


# ---- the Metal twin: a decode step's SwitchGLU, gate and up in one dispatch (Metal pretended here)


@pytest.fixture(scope="module")
def metal_model():
    """Experts 512 wide, so that down's K, like gate's and up's, is a multiple of 512: gather_qmv_fast's shapes."""
    return tiny_language_model(512, seed=3)


@pytest.fixture(scope="module")
def metal_stock_outputs(metal_model):
    glm53_patches.disable()
    return outputs(metal_model)


def switch_glu(hidden=512, width=512, bits=4, group=64, dtype=mx.bfloat16, down_bits=None):
    glu = SwitchGLU(32, 32, 1)
    for name, (n, k) in (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)), ("down_proj", (hidden, width))):
        b = down_bits if name == "down_proj" and down_bits else bits
        setattr(glu, name, switch_linear(n, k, b, group, dtype))
    glu.eval()  # as a served model's
    return glu


def test_metal_coverage():
    x, idx = mx.zeros((1, 1, 512), mx.bfloat16), mx.zeros((1, 1, 8), mx.uint32)
    assert experts.unsupported_on_metal(switch_glu(), x, idx) is None
    assert experts.unsupported_on_metal(switch_glu(), mx.zeros((7, 1, 512), mx.bfloat16), mx.zeros((7, 1, 8))) is None
    assert experts.unsupported_on_metal(switch_glu(down_bits=8), x, idx) is None  # down is its own dispatch
    for bits in (2, 3, 5, 6, 8):
        assert experts.unsupported_on_metal(switch_glu(bits=bits), x, idx) is None
    assert experts.unsupported_on_metal(switch_glu(), x.astype(mx.float16), idx) == "dtype"
    assert experts.unsupported_on_metal(switch_glu(dtype=mx.float16), x.astype(mx.float16), idx) is None
    assert experts.unsupported_on_metal(switch_glu(dtype=mx.float32), x.astype(mx.float32), idx) == "dtype"
    block = mx.zeros((1, 4, 512), mx.bfloat16), mx.zeros((1, 4, 8), mx.uint32)
    assert experts.unsupported_on_metal(switch_glu(), *block) == "not a decode step"  # stock's exact block path
    eight = mx.zeros((8, 1, 512), mx.bfloat16), mx.zeros((8, 1, 8), mx.uint32)
    assert experts.unsupported_on_metal(switch_glu(), *eight) == "sorted"
    assert experts.unsupported_on_metal(switch_glu(width=256), x, idx) == "shape"  # down's K: gather_qmv, not fast
    assert experts.unsupported_on_metal(switch_glu(width=640), x, idx) == "shape"
    assert experts.unsupported_on_metal(switch_glu(group=64, bits=4), x, idx.astype(mx.int32)) is None
    odd = switch_glu()
    odd.up_proj = switch_linear(512, 512, 8)
    assert experts.unsupported_on_metal(odd, x, idx) == "gate and up differ"
    odd.up_proj = switch_linear(512, 512, bias=True)
    assert experts.unsupported_on_metal(odd, x, idx) == "bias"
    training = switch_glu()
    training.train()
    assert experts.unsupported_on_metal(training, x, idx) == "not a decode step"


def stock_expert_qmv(x, idx, projections, bits, group_size):
    """Stands in for ``kernel.expert_qmv``: stock's ``gather_qmm`` for each projection, each route's input row
    found as the twin finds it (``r // (R / X)``)."""
    per_route = mx.repeat(x, idx.shape[0] // x.shape[0], axis=0)[:, None, :]
    return [mx.gather_qmm(per_route, w, s, b, rhs_indices=idx, transpose=True, group_size=group_size,
                          bits=bits)[:, 0, :] for w, s, b in projections]


def test_on_metal_the_twin_gets_stocks_arguments(monkeypatch, metal_model, metal_stock_outputs):
    actual, seen = run_pretending(monkeypatch, metal_model, [NAME], "metal")
    assert_bitwise(metal_stock_outputs, actual, "decode and verify blocks, the twin's calls answered by gather_qmm")
    # decode at batch 1 and 2: gate and up of one input per token (2 projections), then down of an input per route
    assert {(8, 1, 2, 512, 512), (8, 8, 1, 512, 512), (16, 2, 2, 512, 512), (16, 16, 1, 512, 512)} == set(seen)
    hits, fallbacks = counts()
    assert hits["metal twin"] == len(seen) // 2
    assert set(fallbacks) == {"not a decode step"}  # prefill and the verify blocks


def test_on_metal_a_wrong_route_changes_the_outputs(monkeypatch, metal_model):
    """The model comparison can fail: a twin that takes the routes in reverse gives other logits (the first
    decode steps at batch 1 suffice), where the right routes give stock's."""
    steps = lambda model: greedy_logits(model, PROMPT, 2)  # noqa: E731
    glm53_patches.disable()
    stock = steps(metal_model)
    right, _ = run_pretending(monkeypatch, metal_model, [NAME], "metal", run=steps)
    assert_bitwise(stock, right, "the right routes")
    reversed_routes = lambda x, idx, *a: stock_expert_qmv(x, idx[::-1], *a)  # noqa: E731
    wrong, seen = run_pretending(monkeypatch, metal_model, [NAME], "metal", reversed_routes, run=steps)
    assert seen
    with pytest.raises(AssertionError):
        assert_bitwise(stock, wrong, "routes reversed")


def test_verifys_metal_op_check_runs_through_the_wrapper(monkeypatch):
    """verify's Metal-only op cases, at small widths, Metal pretended and the twin answered by gather_qmm: every
    case is taken by the wrapper; a twin that gets a route wrong is reported as differing."""
    from glm53_patches.exactness import Tally
    from glm53_patches.patches.routed_experts.checks import verify

    small = [(label, 1024, 512, bits, group, dtype, batch) for label, _, _, bits, group, dtype, batch
             in verify.METAL_CALLS]
    monkeypatch.setattr(verify, "METAL_CALLS", small)
    monkeypatch.setattr(verify, "EXPERTS", 16)
    monkeypatch.setattr(experts, "gpu_backend", lambda: "metal")
    monkeypatch.setattr(kernel, "expert_qmv", stock_expert_qmv)
    tally = Tally()
    verify.check_metal_op(tally)
    result = tally.result(0.1)
    assert result["exact"] and result["cases"] == len(small), result["detail"]
    monkeypatch.setattr(kernel, "expert_qmv", lambda x, idx, *a: stock_expert_qmv(x, idx[::-1], *a))
    wrong = Tally()
    verify.check_metal_op(wrong)
    assert not wrong.result(0.1)["exact"]
