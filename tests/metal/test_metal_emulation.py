"""Metal twins against the stock Metal kernels they mirror, emulated on the host, bit for bit (glm53_patches/checks/metal/emulate/).

Each case runs the twin (the source MLX generates for it) and stock (MLX's and
mlx-vlm's own kernel texts, op by op where stock is a chain) through one shim,
on the same inputs, and compares every output element. Mutations of the
twins' text must make the comparison fail.

What these tests cannot show, and where a Mac's ``glm53-patches verify`` is
the only check: the Metal compiler's fma contraction (here g++ contracts
nothing, or, with ``contract=True``, contracts both sides as it sees fit),
the hardware's ``simd_sum`` order (both sides use the shim's, three orders
tried), its fast ``exp``, its bfloat arithmetic (here: in float, rounded to
nearest even), and pipeline thread and threadgroup-memory limits.
"""

import mlx.core as mx
import numpy as np
import pytest

from glm53_patches.checks.metal import cases, emulate
from glm53_patches.checks.metal.emulate import (block_qmv, dsa_decode, expert_combine, fused_kda_kernel, hc_decode,
                                                routed_experts, router_select)
from glm53_patches.patches.dsa_decode.checks import host_check
from glm53_patches.patches.expert_combine import kernel as combine


def _agree(result):
    assert result and all(stock.size for stock, _ in result.values())
    assert not emulate.differences(result)


# ---- the shim


SHIM_PROGRAM = r"""
int main(int argc, char** argv) {
  int fast_differs = 0, bare_is_fast = 0, metal_is_fast = 0, rsqrt_differs = 0;
  for (int i = 0; i < 1000; ++i) {
    const float x = -20.0f + 0.04f * i;
    fast_differs += metal::fast::exp(x) != metal::precise::exp(x);
    bare_is_fast += exp(x) == metal::fast::exp(x);
    metal_is_fast += metal::exp(x) == metal::fast::exp(x);
    rsqrt_differs += metal::rsqrt(1.0f + 0.37f * i) != metal::precise::rsqrt(1.0f + 0.37f * i);
  }
  std::vector<int> counts{fast_differs, bare_is_fast, metal_is_fast, rsqrt_differs};
  save(argv[1], counts);
  return 0;
}
"""


def test_shim_fast_exp_is_not_precise(tmp_path):
    """``metal::fast::exp``, ``metal::exp`` and a bare ``exp`` are one function, and it is not ``precise::exp``."""
    counts = emulate.execute(tmp_path, emulate.PRELUDE + SHIM_PROGRAM, {}, {"counts": np.int32})["counts"]
    fast_differs, bare_is_fast, metal_is_fast, rsqrt_differs = counts
    assert fast_differs > 500 and bare_is_fast == metal_is_fast == 1000 and rsqrt_differs > 100


# ---- expert_combine


def _combine_inputs(rows, k, hidden, dtype, seed=0):
    key = iter(mx.random.split(mx.random.key(seed), 3))
    routed = (3 * mx.random.normal((rows, 1, k, hidden), key=next(key))).astype(dtype)
    weights = 2.5 * mx.softmax(mx.random.normal((rows, 1, k), key=next(key)), axis=-1)
    shared = mx.random.normal((rows, 1, hidden), key=next(key)).astype(dtype)
    return routed, weights, shared


# verify's width (hidden 4096, top 8), the tiny model's (hidden 128, top 2, batch 1-3), and top 12 (rows split over 8 threads)
COMBINE_CASES = [(1, 8, 4096, mx.bfloat16), (3, 2, 128, mx.bfloat16), (1, 2, 128, mx.float32), (2, 12, 256, mx.bfloat16),
                 (4, 8, 256, mx.float16)]


@pytest.mark.parametrize("rows, k, hidden, dtype", COMBINE_CASES)
def test_expert_combine_matches_col_reduce_small(tmp_path, rows, k, hidden, dtype):
    _agree(expert_combine.run(tmp_path, *_combine_inputs(rows, k, hidden, dtype)))


# main's Metal body (4ed0234): products summed into a float32 accumulator
MAIN_FLOAT_ACCUMULATOR = r"""
  const ulong i = thread_position_in_grid.x;
  const ulong total = (ulong)sizes[0] * H;
  if (i >= total) {
    return;
  }
  const ulong row = i / H;
  const ulong h = i - row * H;
  const device T* r = routed + row * K * H + h;
  const device float* w = weights + row * K;
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) {
    acc = acc + static_cast<float>(T(r[(ulong)k * H] * static_cast<T>(w[k])));
  }
  out[i] = T(static_cast<T>(acc) + shared[i]);
"""


def test_expert_combine_float_accumulator_fails(tmp_path, monkeypatch):
    monkeypatch.setitem(combine.KERNEL, "metal", (MAIN_FLOAT_ACCUMULATOR, ""))
    stock, twin = expert_combine.run(tmp_path, *_combine_inputs(3, 8, 256, mx.bfloat16))["out"]
    assert (stock != twin).mean() > 0.1  # a third of bf16 outputs round differently


def test_excerpts_are_mlx_text():
    """The stock text comes from the installed MLX headers and the committed .metal excerpt, unchanged."""
    text = expert_combine.stock_text()
    assert "[[kernel]] void col_reduce_small(" in text and "totals[i] = op(cast_to<U>(row[i]), totals[i]);" in text
    assert (emulate.HEADERS / "reduction/reduce_col.h").read_text().count(
        emulate.excerpt("reduction/reduce_col.h", "[[kernel]] void col_reduce_small(").split("\n", 1)[1].rstrip("\n")) == 1
    rms = emulate.snapshot("[[kernel]] void rms_single_row(")
    assert "metal::precise::rsqrt(acc / axis_size + eps)" in rms and rms.count("simd_sum(") == 2


# ---- router_select: Sigmoid/Add/Negative, the merge sort, take, row_reduce_small, Add/Divide/Multiply


def _router_rows(rows, experts, seed):
    """Rows in turn: N(0, 0.5), N(0, 3), N(0, 20) (the sigmoid saturates: tied scores), values repeated in runs
    of 24 (exact ties), a row with NaN (verify's router cases), and N(-4, 1): every pick scores below 0.5, where
    the sigmoid's result is ``y = 1 / (1 + exp(|x|))`` itself (above 0.5 it is ``1 - y``, whose rounding hides
    the last bits of exp: there the exp spelling does not show)."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rows):
        kind = r % 6
        if kind < 3:
            out.append(rng.normal(0, (0.5, 3, 20)[kind], experts))
        elif kind == 3:
            out.append(np.repeat(rng.normal(0, 1, -(-experts // 24)), 24)[:experts])
        elif kind == 4:
            row = rng.normal(0, 1, experts)
            row[rng.permutation(experts)[: max(1, experts // 10)]] = np.nan
            out.append(row)
        else:
            out.append(rng.normal(-4, 1, experts))
    return np.array(out, np.float32)


# (name, rows, experts, top_k, norm, bias): verify's (288 experts, top 8; rows 1 and 8, random and zero bias), the
# tiny model's (8 experts, top 2, batch 1 and 3), inputs under 8 elements, a 256-thread sort (1,000 experts), top 1.
ROUTER_CASES = [
    ("288 experts, top 8, 1 row", 1, 288, 8, True, "random"),
    ("288 experts, top 8, 8 rows: spreads 0.5 / 3 / 20, ties, NaN, all negative", 8, 288, 8, True, "random"),
    ("288 experts, top 8, 6 rows, zero bias", 6, 288, 8, True, "zero"),
    ("288 experts, top 8, no normalisation", 2, 288, 8, False, "random"),
    ("8 experts, top 2, batch 1", 1, 8, 2, True, "random"),
    ("8 experts, top 2, batch 3", 3, 8, 2, True, "random"),
    ("7 experts, top 2 (inputs under 8 elements)", 6, 7, 2, True, "random"),
    ("1000 experts, top 32", 6, 1000, 32, True, "random"),
    ("50 experts, top 1", 6, 50, 1, True, "random"),
]


def _router_inputs(rows, experts, bias):
    logits = _router_rows(rows, experts, seed=rows + experts)
    b = np.random.default_rng(1).normal(0, 0.1, experts).astype(np.float32) if bias == "random" \
        else np.zeros(experts, np.float32)
    return logits, b


@pytest.mark.parametrize("name, rows, experts, top_k, norm, bias", ROUTER_CASES, ids=[c[0] for c in ROUTER_CASES])
def test_router_select_matches_stock_chain(tmp_path, name, rows, experts, top_k, norm, bias):
    result = router_select.run(tmp_path, *_router_inputs(rows, experts, bias), top_k, norm=norm)
    _agree(result)
    assert (result["indices"][0] >= 0).all() and (result["indices"][0] < experts).all()


def _router_twin(experts, top_k, edit):
    from glm53_patches.patches.router_select import kernel

    logits, bias = _router_inputs(8, experts, "random")
    text = emulate.generated(lambda l, b: kernel.router_select(l, b, top_k, True, 2.5, backend="metal"),
                             mx.array(logits), mx.array(bias))
    edited = edit(text)
    assert edited != text, "the mutation did not apply"
    return edited


ROUTER_MUTATIONS = {
    # the sigmoid with the bare (fast) exp, as main's Metal text had it
    "metal::exp in the sigmoid": lambda t: t.replace("metal::precise::exp(metal::abs(x))", "metal::exp(metal::abs(x))"),
    # CUDA's weight sum (row_reduce_simple: chunks of 4, then a tree) instead of row_reduce_small's in-order sum
    "weight sum in chunks of 4": lambda t: t.replace("i < SUMCHUNK;", "i < 4;").replace("c * SUMCHUNK + i", "c * 4 + i"),
}


@pytest.mark.parametrize("mutation", sorted(ROUTER_MUTATIONS))
def test_router_select_mutations_fail(tmp_path, mutation):
    twin = _router_twin(288, 8, ROUTER_MUTATIONS[mutation])
    result = router_select.run(tmp_path, *_router_inputs(8, 288, "random"), 8, twin_source=twin)
    assert emulate.differences(result).get("weights")


def test_router_select_radix_order_fails(tmp_path):
    """ORDER 1 (a radix-select partition's order) is not the order of Metal's merge sort: indices differ."""
    result = router_select.run(tmp_path, *_router_inputs(8, 288, "random"), 8, order=1)
    assert emulate.differences(result).get("indices")


# ---- fused_kda_kernel: depthwise_conv_1d, SiLU, rms_single_row, compute_g_safe, mlx-vlm's gated delta, o_norm, gate


# verify's (4 heads of 64, 64 heads of 128; batch 1 and a left-padded batch of 3), 2 heads of 128 with a mask of
# one element (constant memory), and head dims 96 (3 values per lane) and 32 (8 simdgroups).
KDA_CASES = [(1, 4, 64, False), (3, 4, 64, True), (1, 64, 128, False), (3, 64, 128, True), (1, 2, 128, True),
             (2, 3, 96, True), (1, 4, 32, False)]
_MASK = [True, False, True]


def _kda(batch, heads, dim, masked):
    return cases.fused_kda_inputs(batch, heads, dim)[:10], mx.array(_MASK[:batch]) if masked else None


@pytest.mark.parametrize("batch, heads, dim, masked", KDA_CASES)
def test_fused_kda_matches_stock_chain(tmp_path, batch, heads, dim, masked):
    inputs, mask = _kda(batch, heads, dim, masked)
    result = fused_kda_kernel.run(tmp_path, *inputs, mask)
    _agree(result)
    for row in np.flatnonzero(~np.array(mask)) if masked else ():  # a masked row keeps its state, bit for bit
        old = np.array(inputs[6].view(mx.uint32)).reshape(batch, -1)
        assert (result["state"][0].reshape(batch, -1)[row] == old[row]).all()


def _kda_twin(batch, heads, dim, masked, edit):
    from glm53_patches.patches.fused_kda_kernel import kernel

    inputs, mask = _kda(batch, heads, dim, masked)
    consts, scales = kernel.constants(1e-6 / dim, 1e-5, -5.0, dim**-0.5)
    text = emulate.generated(lambda *x: kernel.fused_kda_step(*x, mask, backend="metal"), *inputs, consts, scales)
    edited = edit(text)
    assert edited != text, "the mutation did not apply"
    return inputs, mask, edited


KDA_MUTATIONS = {
    # main's lane layout: 4 key values per lane at head dim 64 (stock's recurrence holds Dk / 32 = 2)
    "4 values per lane at D=64": lambda t: t.replace("#define KD_PER (D / 32)", "#define KD_PER 4"),
    # the conv summed in half instead of depthwise_conv_1d's float
    "conv accumulator in half": lambda t: t.replace("  float acc = 0.0;\n  for (int j = 0; j < KC - 1; ++j) {",
                                                    "  half acc = 0.0;\n  for (int j = 0; j < KC - 1; ++j) {"),
    # the bare (fast) exp wherever stock's functors use precise::exp
    "metal::exp for precise::exp": lambda t: t.replace("metal::precise::exp", "metal::exp"),
    # a masked row's y computed, where stock's kernel writes 0
    "masked row's y not zeroed": lambda t: t.replace("static_cast<bfloat16_t>((live) ? (y) : 0.0f)",
                                                     "static_cast<bfloat16_t>(y)"),
}


@pytest.mark.parametrize("mutation", sorted(KDA_MUTATIONS))
def test_fused_kda_mutations_fail(tmp_path, mutation):
    inputs, mask, twin = _kda_twin(3, 4, 64, True, KDA_MUTATIONS[mutation])
    assert emulate.differences(fused_kda_kernel.run(tmp_path, *inputs, mask, twin_source=twin))


def test_fused_kda_fma_variant_differs(tmp_path):
    """FMA_STATE == 1 (explicit metal::fma) is other code than stock's uncontracted recurrence: the state differs."""
    inputs, mask = _kda(3, 4, 64, True)
    assert emulate.differences(fused_kda_kernel.run(tmp_path, *inputs, mask, fma=(1, 1))).get("state")


# ---- hc_decode: mlx-vlm's _hc_kernel


HC_CASES = [(name, args) for name, _, args in cases.hc_decode()]


@pytest.mark.parametrize("name, args", HC_CASES, ids=[c[0] for c in HC_CASES])
def test_hc_decode_matches_upstream_kernel(tmp_path, name, args):
    _agree(hc_decode.run(tmp_path, *args))


def _hc_twin(edit):
    from glm53_patches.kernels import hc_sinkhorn

    # float32: a float's last bits survive into the collapsed output (bf16's rounding hides most of them)
    args = dict(HC_CASES)["mlx.core.float32 batch 3, hidden 128"]
    text = emulate.generated(lambda *a: hc_sinkhorn.hc_sinkhorn_collapse(*a, 4, 20, 1e-6, backend="metal"), *args)
    edited = edit(text)
    assert edited != text, "the mutation did not apply"
    return args, edited


HC_MUTATIONS = {
    # precise exp where upstream's kernel has fast::exp
    "precise::exp for fast::exp": lambda t: t.replace("metal::fast::exp", "metal::precise::exp"),
    # the collapse's fma chain in the other stream order
    "collapse from stream 3 down": lambda t: t.replace(
        "fma(float4(p0), x0,\n                      fma(float4(p1), x1,\n                      fma(float4(p2), x2, float4(p3) * x3)))",
        "fma(float4(p3), x3,\n                      fma(float4(p2), x2,\n                      fma(float4(p1), x1, float4(p0) * x0)))"),
}


@pytest.mark.parametrize("mutation", sorted(HC_MUTATIONS))
def test_hc_decode_mutations_fail(tmp_path, mutation):
    args, twin = _hc_twin(HC_MUTATIONS[mutation])
    assert emulate.differences(hc_decode.run(tmp_path, *args, twin_source=twin))


# ---- dsa_decode: the selection after the pool scores, through Metal's merge sort


def _dsa_cases():
    """host_check's cases (decode tokens and short blocks) that fit Metal's 8,128 pools, and cases at that capacity:
    ties at the boundary among -0 and +0 and NaN past it (4 blocks of the multi-block merge sort), a short pool cache;
    a batch of one (inputs of fewer than 8 elements: constant memory); verify's 2,040 keys (every pool selected)."""
    rng = np.random.default_rng(0)
    found = [(name, case) for name, *case, real in host_check.cases(rng) if case[0].shape[-1] <= 8128]
    pools, keys = 8128, 8128 * 16
    ties = rng.integers(-39, 1, (1, pools)).astype(np.float32)  # ~200 pools at 0, the boundary value
    ties[ties == 0] = np.where(rng.random(int((ties == 0).sum())) < 0.5, -0.0, 0.0)
    nan = rng.normal(0, 1, (1, pools)).astype(np.float32)
    nan[0, rng.permutation(pools)[60:]] = np.nan  # 60 finite scores: the 128th pick is a NaN
    valid = np.ones((2, keys), bool)
    valid[1, 50000:50033] = False
    real = (128, 16, 2048, 15)
    token = np.ones((2, 1), bool)  # decode tokens: one position a row
    found.append(("8128 pools: ties at the boundary with -0/+0, NaN past it",
                  (np.concatenate([ties, nan])[:, None], valid, np.array([pools, pools]), token, *real)))
    found.append(("8128 pools: a pool cache of 100, holes", (rng.normal(0, 1, (2, 1, pools)).astype(np.float32), valid,
                                                             np.array([100, pools - 5]), token, *real)))
    found.append(("batch 1, 4096 keys", (rng.normal(0, 1, (1, 1, 256)).astype(np.float32), np.ones((1, 4096), bool),
                                         np.array([256]), token[:1], *real)))
    found.append(("2040 keys: every pool selected", (rng.normal(0, 1, (2, 1, 127)).astype(np.float32),
                                                     np.ones((2, 2040), bool), np.array([127, 127]), token,
                                                     127, 16, 2048, 15)))
    return found


DSA_CASES = _dsa_cases()
# one build per width: every case of a width gets the sort instances of all of them
_DSA_SORTS = {}
for _, (s, _kv, _l, _q, _k, kpool, topk, tail) in DSA_CASES:
    _DSA_SORTS.setdefault((kpool, topk, tail), set()).update((s.shape[-1], _k))


@pytest.mark.parametrize("name, case", DSA_CASES, ids=[c[0] for c in DSA_CASES])
def test_dsa_decode_matches_stock_sort(tmp_path, name, case):
    scores, key_valid, limit, query_valid, select_k, kpool, topk, tail = case
    result = dsa_decode.run(tmp_path, scores, key_valid, limit, query_valid, select_k, kpool=kpool, topk=topk,
                            tail=tail, sort_sizes=_DSA_SORTS[(kpool, topk, tail)])
    _agree(result)
    want = host_check.reference(scores, key_valid, limit, query_valid, select_k, kpool, topk, tail).reshape(-1)
    assert np.array_equal(result["topk"][0], want)  # Metal's sort is a stable sort here, as the reference assumes


DSA_MUTATIONS = {
    # the last pools equal to the boundary key instead of the first (a stable sort takes the first)
    "ties: the last equal pools": lambda t: t.replace("chosen = is_less || (is_equal && rank < equal_wanted);",
                                                      "chosen = is_less || (is_equal && rank >= equal - equal_wanted);"),
    # -0 and +0 as different keys (LessThan has them equal)
    "-0 below +0": lambda t: t.replace("if (v == 0.0f) return 0x80000000u;\n", ""),
}


@pytest.mark.parametrize("mutation", sorted(DSA_MUTATIONS))
def test_dsa_decode_mutations_fail(tmp_path, mutation):
    from glm53_patches.patches.dsa_decode import select_kernel

    name, case = DSA_CASES[-4]  # the ties among -0 / +0
    scores, key_valid, limit, query_valid, select_k, kpool, topk, tail = case
    inputs = (mx.array(scores), mx.array(key_valid), mx.array(limit.astype(np.int32)), mx.array(query_valid))
    text = emulate.generated(lambda *a: select_kernel.select_topk(*a, select_k, kpool=kpool, topk=topk,
                                                                  tail_width=tail, backend="metal"), *inputs)
    twin = DSA_MUTATIONS[mutation](text)
    assert twin != text, "the mutation did not apply"
    result = dsa_decode.run(tmp_path, scores, key_valid, limit, query_valid, select_k, kpool=kpool, topk=topk,
                            tail=tail, twin_source=twin)
    assert emulate.differences(result)


# ---- block_qmv: affine_gather_qmv_fast, qmv_fast_impl once per position


def _block_inputs(n, k, positions, bits, group, dtype, seed=0):
    key_w, key_x = mx.random.split(mx.random.key(seed))
    w = (mx.random.normal((n, k), key=key_w) * k**-0.5).astype(dtype)
    return (mx.random.normal((positions, k), key=key_x).astype(dtype), *mx.quantize(w, group_size=group, bits=bits))


def _block_twin(n, k, positions, bits, group, dtype, edit):
    from glm53_patches.patches.block_qmv import kernel

    text = emulate.generated(lambda *a: kernel.block_qmv(*a, bits, group, backend="metal"),
                             *_block_inputs(n, k, positions, bits, group, dtype))
    edited = edit(text)
    assert edited != text, "the mutation did not apply"
    return edited


# every bit width the patch takes at 2 and 7 positions; float16, groups 32 and 128, 3 to 5 positions, K of 1 to 4 blocks
BLOCK_CASES = ([(bits, positions, mx.bfloat16, 64, 1024) for bits in (2, 3, 4, 5, 6, 8) for positions in (2, 7)]
               + [(4, 4, mx.float16, 64, 512), (8, 3, mx.float16, 32, 1024), (4, 5, mx.bfloat16, 128, 2048),
                  (6, 4, mx.bfloat16, 32, 512)])


@pytest.mark.parametrize("bits, positions, dtype, group, k", BLOCK_CASES)
def test_block_qmv_matches_gather_qmv_fast(tmp_path, bits, positions, dtype, group, k):
    x, w, scales, biases = _block_inputs(24, k, positions, bits, group, dtype)
    _agree(block_qmv.run(tmp_path, x, w, scales, biases, bits, group))


BLOCK_MUTATIONS = {
    # each position's qdot with the first position's input sum (the bias term)
    "another position's input sum": lambda t: t.replace("x_thread[p], s, b, sum[p])", "x_thread[p], s, b, sum[0])"),
    # a scale and bias per block of values instead of per group
    "one scale per block": lambda t: t.replace("sc += block_size / GROUP;", "sc += 1;"),
    # each position's partial sums reduced before the last block (qmv reduces once, at the end)
    "reduced per block": lambda t: t.replace(
        "    xs += block_size;\n",
        "    xs += block_size;\n    for (int p = 0; p < POSITIONS; p++) { result[p][0] = simd_sum(result[p][0]); }\n"),
}


@pytest.mark.parametrize("mutation", sorted(BLOCK_MUTATIONS))
def test_block_qmv_mutations_fail(tmp_path, mutation):
    twin = _block_twin(24, 1024, 3, 4, 64, mx.bfloat16, BLOCK_MUTATIONS[mutation])
    x, w, scales, biases = _block_inputs(24, 1024, 3, 4, 64, mx.bfloat16)
    assert emulate.differences(block_qmv.run(tmp_path, x, w, scales, biases, 4, 64, twin_source=twin))


def test_block_qmv_calls_the_installed_mlx_helpers():
    """The twin's load_vector and qdot are the installed MLX's own text, the functions qmv_fast_impl calls."""
    from glm53_patches.patches.block_qmv import kernel

    text = emulate.generated(lambda *a: kernel.block_qmv(*a, 4, 64, backend="metal"),
                             *_block_inputs(16, 512, 2, 4, 64, mx.bfloat16))
    for start in ("inline U load_vector(const device T* x, thread U* x_thread)", "inline U qdot("):
        mlx_text = (emulate.HEADERS / "quantized.h").read_text()
        function = emulate.excerpt("quantized.h", start).split("\n", 1)[1]
        assert mlx_text.count(function.rstrip("\n")) == 1 and function in text, start
    assert "load_vector<T, U, values_per_thread, bits>(x, x_thread)" in block_qmv.stock_text()


# ---- routed_experts: affine_gather_qmv_fast once per projection and route; the twin takes gate and up at once


def _expert_inputs(n, k, rows, routes, bits, group, dtype, count, experts=4, seed=0):
    """An input of ``rows`` rows, ``routes`` random expert picks and ``count`` projections of ``experts`` experts."""
    keys = mx.random.split(mx.random.key(seed), 2 + count)
    x = mx.random.normal((rows, k), key=keys[0]).astype(dtype)
    idx = mx.random.randint(0, experts, (routes,), key=keys[1]).astype(mx.uint32)
    projections = [mx.quantize((mx.random.normal((experts, n, k), key=key) * k**-0.5).astype(dtype),
                               group_size=group, bits=bits) for key in keys[2:]]
    return x, idx, projections


# (bits, group, dtype, K, input rows, routes, projections): a decode step's gate and up (one input, 8 routes) and
# down (an input per route), batch 2, every bit width the twin takes, float16, groups 32 and 128
EXPERT_CASES = ([(bits, 64, mx.bfloat16, 1024, 1, 8, 2) for bits in (2, 3, 4, 5, 6, 8)]
                + [(4, 64, mx.bfloat16, 512, 8, 8, 1), (8, 64, mx.bfloat16, 1024, 16, 16, 1),
                   (4, 64, mx.bfloat16, 512, 2, 16, 2), (4, 32, mx.float16, 1024, 1, 8, 2),
                   (6, 128, mx.bfloat16, 2048, 2, 16, 2)])


@pytest.mark.parametrize("bits, group, dtype, k, rows, routes, count", EXPERT_CASES)
def test_routed_experts_twin_matches_gather_qmv_fast(tmp_path, bits, group, dtype, k, rows, routes, count):
    x, idx, projections = _expert_inputs(16, k, rows, routes, bits, group, dtype, count)
    result = routed_experts.run(tmp_path, x, idx, projections, bits, group)
    assert len(result) == count
    _agree(result)


EXPERT_MUTATIONS = {
    # up's rows read with gate's scales (the second projection with the first's)
    "one projection's scales for both": lambda t: t.replace("U s = sc[p][row", "U s = sc[0][row"),
    # each route's input row taken per route rather than per PER_ROW routes
    "the wrong input row": lambda t: t.replace("x + (route / PER_ROW) * K", "x + (route % PER_ROW) * K"),
    # every route through the first route's expert
    "one expert for every route": lambda t: t.replace("size_t(idx[route])", "size_t(idx[0])"),
    # the first of a SIMD-group's 4 rows' scale for all of them
    "one row's scale": lambda t: t.replace("U s = sc[p][row * in_vec_size_g];", "U s = sc[p][0];"),
}


@pytest.mark.parametrize("mutation", sorted(EXPERT_MUTATIONS))
def test_routed_experts_mutations_fail(tmp_path, mutation):
    from glm53_patches.patches.routed_experts import kernel

    x, idx, projections = _expert_inputs(16, 1024, 2, 16, 4, 64, mx.bfloat16, 2)
    text = emulate.generated(lambda x, i, *a: kernel.expert_qmv(x, i, [a[:3], a[3:]], 4, 64), x, idx,
                             *projections[0], *projections[1])
    twin = EXPERT_MUTATIONS[mutation](text)
    assert twin != text, "the mutation did not apply"
    assert emulate.differences(routed_experts.run(tmp_path, x, idx, projections, 4, 64, twin_source=twin))


# ---- the hardware's unknowns: simd_sum order, thread order, contraction


VARIANTS = {"simd_sum from lane 0, threads in reverse": dict(simd_order=1, reverse=True),
            "simd_sum from lane 31": dict(simd_order=2)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_agreement_does_not_depend_on_simd_sum_order(tmp_path, variant):
    """The twins hand simd_sum the lane values stock does: they agree under each order the shim can add them in."""
    options = VARIANTS[variant]
    inputs, mask = _kda(3, 4, 64, True)
    _agree(fused_kda_kernel.run(tmp_path, *inputs, mask, **options))
    _agree(hc_decode.run(tmp_path, *dict(HC_CASES)["mlx.core.bfloat16 batch 3, hidden 128"], **options))
    _agree(router_select.run(tmp_path, *_router_inputs(8, 288, "random"), 8, **options))
    name, case = DSA_CASES[-4]
    scores, key_valid, limit, query_valid, select_k, kpool, topk, tail = case
    _agree(dsa_decode.run(tmp_path, scores, key_valid, limit, query_valid, select_k, kpool=kpool, topk=topk,
                          tail=tail, **options))
    _agree(block_qmv.run(tmp_path, *_block_inputs(24, 1024, 5, 6, 64, mx.bfloat16), 6, 64, **options))
    x, idx, projections = _expert_inputs(16, 1024, 2, 16, 6, 64, mx.bfloat16, 2)
    _agree(routed_experts.run(tmp_path, x, idx, projections, 6, 64, **options))


def test_hc_decode_agrees_under_contraction(tmp_path):
    """With g++ contracting a * b + c into fmas (-O2 -ffp-contract=fast) on both sides, the hyper-connection twin
    (upstream's statements, regrouped) still matches. Whether the Metal compiler contracts them alike is unknown here."""
    for name in ("mlx.core.bfloat16 batch 3, hidden 128", "mlx.core.float32 batch 1, hidden 4096"):
        _agree(hc_decode.run(tmp_path, *dict(HC_CASES)[name], contract=True))


def test_block_qmv_agrees_under_contraction(tmp_path):
    """With g++ contracting a * b + c into fmas on both sides, the block twin (stock's qdot, called per position)
    still matches: both sides compile the same function. Whether Metal inlines it alike is for a Mac's verify."""
    for bits in (4, 8):
        _agree(block_qmv.run(tmp_path, *_block_inputs(24, 1024, 4, bits, 64, mx.bfloat16), bits, 64, contract=True))


def test_routed_experts_agrees_under_contraction(tmp_path):
    """With g++ contracting on both sides, the experts' twin (stock's load_vector and qdot, called per projection)
    still matches."""
    for bits in (4, 8):
        x, idx, projections = _expert_inputs(16, 1024, 1, 8, bits, 64, mx.bfloat16, 2)
        _agree(routed_experts.run(tmp_path, x, idx, projections, bits, 64, contract=True))
