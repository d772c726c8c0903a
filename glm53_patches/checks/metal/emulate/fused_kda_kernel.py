"""fused_kda_kernel's Metal twin against the stock Metal chain of a KDA decode step after the projections.

Stock on Metal (mlx-vlm 0.7.10 ``Glm5NextLinearAttention.__call__``, one token,
a cache, MLX 0.32.4), from the masked ``qkv`` projection on:

1. ``ShortConv1d``: ``concatenate([window, qkv])`` (a copy), ``nn.Conv1d`` with
   ``groups == channels``, which MLX runs as ``depthwise_conv_1d`` (conv.cpp
   ``conv_1D_gpu``; grid (channels, 1, B)), then ``nn.silu``: a compiled
   ``Multiply(x, Sigmoid(x))`` on bf16; the new window is the last ``KC - 1``
   rows (``update_window``: a copy);
2. ``mx.fast.rms_norm(q / k, None, 1e-6 / D)``: ``rms_single_row`` with the
   weight ``array(1, bf16)`` at stride 0 (fast.cpp, normalization.cpp: 32
   threads per row up to 128 wide), then ``Multiply`` by the Python float
   ``scale**2`` / ``scale`` as MLX converts it to bf16;
3. ``gated_delta_update``: ``Sigmoid(b)`` (bf16); ``compute_g_safe``
   compiled: ``Exp(Multiply(c, Sigmoid(Multiply(Exp(A_log), Add(a, dt_bias)))))``
   in float32 with ``c`` the constant a compiled kernel reads for
   ``lower_bound``; then mlx-vlm's own ``gated_delta_kernel`` (``g`` per key
   dim: the vectorized kernel; its masked form where the layer has a mask), as
   MLX generates it;
4. ``o_norm``: ``rms_single_row`` with the layer's bf16 weight, then
   ``Multiply(o, Sigmoid(gate))`` (bf16).

The functors are kernels/unary_ops.h and binary_ops.h (read from the
installed wheel); ``rms_single_row`` and ``depthwise_conv_1d`` are the
verbatim .metal text in ``mlx_kernels.metal``. Elementwise kernels run as
loops; the norms, the recurrence and the twin as threadgroups. The output,
the new state and the new window are compared bit for bit.

Not shown here: whether the Metal compiler contracts ``acc + a * b`` (the
norms' ``acc += x * x``, the recurrence's ``kv_mem += s * k``,
``s + k * delta``, ``out += s * q``) the same way in stock's kernels and in
the twin. The twin writes each as stock does (``FMA_* == 0``); with
``contract=True`` g++ contracts both sides as it sees fit, and they still
agree; ``FMA_* == 1`` (explicit ``metal::fma``) differs from stock here,
where stock is not contracted.
"""

import numpy as np

import mlx.core as mx

from . import PRELUDE, excerpt, execute, generated, header, launch, pairs, snapshot


def stock_text():
    return (header("defines.h") + excerpt("unary_ops.h", "struct Sigmoid {") + excerpt("unary_ops.h", "struct Exp {")
            + excerpt("binary_ops.h", "struct Add {") + excerpt("binary_ops.h", "struct Multiply {")
            + snapshot("[[kernel]] void rms_single_row(") + snapshot("[[kernel]] void depthwise_conv_1d("))


PROGRAM = r"""
%(stock)s
%(delta)s
%(twin)s
int main(int argc, char** argv) {
  constexpr int B = %(B)d, H = %(H)d, D = %(D)d, KC = %(KC)d, C = 3 * H * D;
  int arg = 1;
  auto qkv = load<bfloat>(argv[arg++], B * C);
  auto window = load<bfloat>(argv[arg++], B * (KC - 1) * C);
  auto conv_w = load<bfloat>(argv[arg++], C * KC);
  auto a = load<bfloat>(argv[arg++], B * H * D);
  auto beta_logit = load<bfloat>(argv[arg++], B * H);
  auto gate = load<bfloat>(argv[arg++], B * H * D);
  auto state = load<float>(argv[arg++], B * H * D * D);
  auto A_log = load<float>(argv[arg++], H);
  auto dt_bias = load<float>(argv[arg++], H * D);
  auto o_weight = load<bfloat>(argv[arg++], D);
  auto scales = load<bfloat>(argv[arg++], 2);      // the twin's inputs
  auto consts = load<float>(argv[arg++], 3);
  auto mask_bytes = load<uint8_t>(argv[arg++], %(MASK_SIZE)d);
  auto stock_params = load<float>(argv[arg++], 3);  // stock's: eps of the q/k norms and of o_norm, lower bound
  auto stock_scales = load<bfloat>(argv[arg++], 2);  // scale**2, scale as MLX converts them to bf16
  const bool* mask = reinterpret_cast<const bool*>(mask_bytes.data());
  auto stock_out = poisoned<bfloat>(B * H * D, STOCK), twin_out = poisoned<bfloat>(B * H * D, TWIN);
  auto stock_state = poisoned<float>(B * H * D * D, STOCK), twin_state = poisoned<float>(B * H * D * D, TWIN);
  auto stock_window = poisoned<bfloat>(B * (KC - 1) * C, STOCK), twin_window = poisoned<bfloat>(B * (KC - 1) * C, TWIN);

  // 1. The window and the conv, SiLU.
  std::vector<bfloat> conv_in(B * KC * C), conv(B * C), act(B * C);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < KC; ++j)
      for (int c = 0; c < C; ++c)
        conv_in[(b * KC + j) * C + c] = j < KC - 1 ? window[(b * (KC - 1) + j) * C + c] : qkv[b * C + c];
  for (int b = 0; b < B; ++b)
    for (int j = 1; j < KC; ++j)
      for (int c = 0; c < C; ++c) stock_window[(b * (KC - 1) + j - 1) * C + c] = conv_in[(b * KC + j) * C + c];
  {
    const int strides[3] = {KC * C, C, 1};
    const int kernel_size = KC;
    msl_each({uint(C), 1, uint(B)}, [&] {
      depthwise_conv_1d<bfloat16_t, int>(conv_in.data(), conv_w.data(), conv.data(), strides, kernel_size,
          __msl.thread_position_in_grid, __msl.threads_per_grid);
    });
  }
  for (int i = 0; i < B * C; ++i) act[i] = Multiply()(conv[i], Sigmoid()(conv[i]));

  // 2. q, k: rms_norm rows of D, then the scale.
  std::vector<bfloat> q(B * H * D), k(B * H * D), v(B * H * D), qn(B * H * D), kn(B * H * D);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < H * D; ++i) {
      q[b * H * D + i] = act[b * C + i];
      k[b * H * D + i] = act[b * C + H * D + i];
      v[b * H * D + i] = act[b * C + 2 * H * D + i];
    }
  const uint row_threads = 32 * (((D + 3) / 4 + 31) / 32);
  auto rms = [&](const bfloat* x, const bfloat* w, uint w_stride, float eps, bfloat* out) {
    uint axis_size = D;
    msl_run({uint(B * H) * row_threads, 1, 1}, {row_threads, 1, 1}, [&] {
      rms_single_row<bfloat16_t>(x, w, out, eps, axis_size, w_stride, __msl.threadgroup_position_in_grid.x,
          __msl.thread_position_in_threadgroup.x, __msl.thread_index_in_simdgroup,
          __msl.simdgroup_index_in_threadgroup);
    });
  };
  const bfloat one[1] = {bfloat(1.0f)};
  rms(q.data(), one, 0, stock_params[0], qn.data());
  rms(k.data(), one, 0, stock_params[0], kn.data());
  for (int i = 0; i < B * H * D; ++i) {
    q[i] = Multiply()(stock_scales[0], qn[i]);
    k[i] = Multiply()(stock_scales[1], kn[i]);
  }

  // 3. beta, g (compute_g_safe), the recurrence.
  std::vector<bfloat> beta(B * H), y(B * H * D), normed(B * H * D);
  std::vector<float> g(B * H * D);
  for (int i = 0; i < B * H; ++i) beta[i] = Sigmoid()(beta_logit[i]);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int e = 0; e < D; ++e) {
        const int i = (b * H + h) * D + e;
        const float x = Add()(static_cast<float>(a[i]), dt_bias[h * D + e]);
        g[i] = Exp()(Multiply()(stock_params[2], Sigmoid()(Multiply()(Exp()(A_log[h]), x))));
      }
  const int32_t T = 1;
  msl_run({32, uint(D), uint(B * H)}, {32, 4, 1}, [&] { %(delta_call)s; });

  // 4. o_norm(y) * sigmoid(gate).
  rms(y.data(), o_weight.data(), 1, stock_params[1], normed.data());
  for (int i = 0; i < B * H * D; ++i) stock_out[i] = Multiply()(normed[i], Sigmoid()(gate[i]));

  // The twin, as the patch launches it: one threadgroup of D / 4 simdgroups per (row, head).
  msl_run({uint(B * H * D / 4 * 32), 1, 1}, {uint(D / 4 * 32), 1, 1}, [&] { %(twin_call)s; });
  int out = arg;
  save(argv[out++], stock_out);
  save(argv[out++], twin_out);
  save(argv[out++], stock_state);
  save(argv[out++], twin_state);
  save(argv[out++], stock_window);
  save(argv[out++], twin_window);
  return 0;
}
"""


def stock_constants(head_dim, eps_out, lower_bound, scale):
    """(float32 [eps q/k, eps o_norm, lower bound], bf16 [scale**2, scale]) as stock's kernels receive them.

    rms_norm's eps is a C++ float (fast.cpp); the lower bound is what a
    compiled kernel reads for the captured Python float (``compiled_constant``);
    ``scale**2 * bf16`` is MLX's multiply by a Python float, whose bf16 value
    ``1 * s`` shows.
    """
    from glm53_patches.kernels import hc_sinkhorn

    params = np.array([1e-6 / head_dim, eps_out, hc_sinkhorn.compiled_constant(lower_bound)], np.float32)
    one = mx.ones((1,), dtype=mx.bfloat16)
    scales = mx.concatenate([one * (scale**2), one * scale])
    return params, scales


def run(tmp, qkv, window, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, mask=None, *,
        eps_out=1e-5, lower_bound=-5.0, fma=(0, 0), twin_source=None, **build_options):
    """{"out", "state", "window": (stock bits, twin bits)} for one decode step, emulated (arguments as ``fused_kda_step``)."""
    from mlx_vlm.models import gated_delta as gd

    from glm53_patches.patches.fused_kda_kernel import kernel

    batch, heads, head_dim = state.shape[0], state.shape[1], state.shape[-1]
    taps = conv_w.shape[1]
    scale = head_dim**-0.5
    consts, scales = kernel.constants(1e-6 / head_dim, eps_out, lower_bound, scale)
    if twin_source is None:
        twin_source = generated(lambda *x: kernel.fused_kda_step(*x, mask, backend="metal", fma=fma), qkv, window,
                                conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, consts, scales)
    shaped = (batch, 1, heads, head_dim)
    bf = mx.bfloat16
    delta_args = [mx.zeros(shaped, bf)] * 3 + [mx.zeros(shaped, mx.float32), mx.zeros((batch, 1, heads), bf), state]
    if mask is not None:
        delta_args.append(mask.reshape(batch, 1))
    delta_source = generated(gd.gated_delta_kernel, *delta_args)
    program = PRELUDE + PROGRAM % {
        "stock": stock_text(), "delta": delta_source, "twin": twin_source, "B": batch, "H": heads, "D": head_dim,
        "KC": taps, "MASK_SIZE": batch if mask is not None else 1,
        "delta_call": launch(delta_source, {"q": "q.data()", "k": "k.data()", "v": "v.data()", "g": "g.data()",
                                            "beta": "beta.data()", "state_in": "state.data()", "T": "T",
                                            "mask": "mask", "y": "y.data()", "state_out": "stock_state.data()"}),
        "twin_call": launch(twin_source, {
            "qkv": "qkv.data()", "window": "window.data()", "conv_w": "conv_w.data()", "a": "a.data()",
            "beta_logit": "beta_logit.data()", "gate": "gate.data()", "state": "state.data()", "A_log": "A_log.data()",
            "dt_bias": "dt_bias.data()", "o_weight": "o_weight.data()", "scales": "scales.data()",
            "consts": "consts.data()", "mask": "mask", "out": "twin_out.data()", "state_out": "twin_state.data()",
            "window_out": "twin_window.data()"}),
    }
    params, stock_scales = stock_constants(head_dim, eps_out, lower_bound, scale)
    inputs = {"qkv": qkv, "window": window, "conv_w": conv_w, "a": a, "beta_logit": beta_logit, "gate": gate,
              "state": state, "A_log": A_log, "dt_bias": dt_bias, "o_weight": o_weight, "scales": scales,
              "consts": consts, "mask": mask if mask is not None else mx.ones((1,), mx.bool_),
              "stock_params": params, "stock_scales": stock_scales}
    names = ["out", "state", "window"]
    bits = {"out": np.uint16, "state": np.uint32, "window": np.uint16}
    found = execute(tmp, program, inputs, {f"{side}_{n}": bits[n] for n in names for side in ("stock", "twin")},
                    **build_options)
    return pairs(found, names)
