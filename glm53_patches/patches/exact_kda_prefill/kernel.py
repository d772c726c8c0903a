"""Stock's per-token gated delta step, looped over a whole prefill chunk in one CUDA launch.

Stock prefill on CUDA runs ``gated_delta_ops``: a Python loop that launches
the compiled ``_gated_delta_step_ops`` once per token (34 KDA layers x 2,048
tokens per chunk for GLM-5.3-Flash). This kernel runs the same step for every
token of the chunk, rounding each value where stock's compiled step rounds it
on CUDA. The arithmetic is fused_kda_kernel's delta rule, which the H200
verified bit for bit against that step at decode:

* ``state * g`` and each product ``state * k``, ``state * q``: float32, rounded
  (``__fmul_rn``); stock materialises the products before it sums them;
* each row sum of Dk products is MLX's ``row_reduce_simple``: lane ``l`` adds
  values ``4l .. 4l+3`` in order from 0, then the warp tree (xor offsets 16
  down to 1), all ``__fadd_rn``;
* ``delta = (v - kv_mem) * beta`` in float32;
* ``state + k * delta``: an fma where stock's fused elementwise kernel is one
  (``FMA_STATE``; ``verify`` tries the other when the default fails);
* ``y`` cast to q's dtype; a masked token keeps the old state, and its ``y``
  is still computed from the state it would have written, as stock's
  ``mx.where(mask, state, old_state)`` after the sums.

Inputs are converted to float32 on load, as stock's type promotion does
(bf16 and float16 widen exactly). Layout: one warp per (batch row, head, 4
state rows); the rows' state lives in registers for the whole chunk, and each
token's q, k, g, v and beta are loaded one token ahead, so the loads overlap
the previous token's sums. With ``STEPS > 0`` the state after each of the
first STEPS tokens is written too (stock's ``state_steps`` history for
speculative rollback).
"""

from typing import Optional

import mlx.core as mx

from glm53_patches.backend import gpu_backend
from glm53_patches.kernels.build import gpu_kernel

PER = 4  # key-dim values per lane: row_reduce_simple's 4 reads per thread
ROWS_PER_WARP = 4  # state rows a warp carries (16 floats of state per lane)
MAX_HEAD_DIM = 32 * PER  # one warp covers a row
THREADS = 128  # per block: 4 independent warps
DEFAULT_FMA_STATE = 1  # what the H200 verified for fused_kda_kernel's step
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)

# Template constants: InT (y's dtype), H, D (Dk = Dv), FMA_STATE, HAS_MASK, STEPS.
CUDA_SOURCE = r"""
  constexpr int R = 4;    // ROWS_PER_WARP
  constexpr int PER = 4;  // values per lane
  constexpr unsigned FULL = 0xffffffffu;
  const long long T = sizes[0];
  const long long warps = sizes[1];  // B * H * (D / R)
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = (int)(threadIdx.x % 32);
  if (warp >= warps) {  // whole warps leave: the grid is rounded up to whole blocks
    return;
  }
  const int row0 = (int)(warp % (D / R)) * R;
  const long long bh = warp / (D / R);  // b * H + h
  const long long b = bh / H;
  const int h = (int)(bh % H);
  const int e0 = PER * lane;  // this lane's first key-dim value

  float s[R][PER];
  const size_t srow = ((size_t)bh * D + row0) * D;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      s[r][i] = e0 + i < D ? state_in[srow + (size_t)r * D + e0 + i] : 0.0f;
    }
  }

  // Token t's rows: q, k, g at ((b T + t) H + h) D, v and y at the same, beta at (b T + t) H + h.
  float qn[PER], kn[PER], gn[PER], vn[R], bn = 0.0f;
  bool mn = true;
  auto load = [&](long long t) {
    const size_t tok = ((size_t)b * T + t) * H + h;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const bool in = e0 + i < D;
      qn[i] = in ? static_cast<float>(q[tok * D + e0 + i]) : 0.0f;
      kn[i] = in ? static_cast<float>(k[tok * D + e0 + i]) : 0.0f;
      gn[i] = in ? static_cast<float>(g[tok * D + e0 + i]) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      vn[r] = static_cast<float>(v[tok * D + row0 + r]);
    }
    bn = static_cast<float>(beta[tok]);
    if constexpr (HAS_MASK) {
      mn = mask[(size_t)b * T + t];
    }
  };
  if (T > 0) {
    load(0);
  }
  for (long long t = 0; t < T; ++t) {
    float qc[PER], kc[PER], gc[PER], vc[R];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      qc[i] = qn[i];
      kc[i] = kn[i];
      gc[i] = gn[i];
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      vc[r] = vn[r];
    }
    const float bc = bn;
    const bool live = mn;
    if (t + 1 < T) {  // the next token's inputs, while this one sums
      load(t + 1);
    }
    float sn[R][PER], kv[R], y[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {  // decay, then kv_mem = sum(state * k)
      kv[r] = 0.0f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        sn[r][i] = __fmul_rn(s[r][i], gc[i]);
        kv[r] = __fadd_rn(kv[r], __fmul_rn(sn[r][i], kc[i]));
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        kv[r] = __fadd_rn(kv[r], __shfl_xor_sync(FULL, kv[r], off));
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {  // the update, then y = sum(state * q)
      const float delta = __fmul_rn(__fsub_rn(vc[r], kv[r]), bc);
      y[r] = 0.0f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        sn[r][i] = FMA_STATE ? __fmaf_rn(kc[i], delta, sn[r][i]) : __fadd_rn(sn[r][i], __fmul_rn(kc[i], delta));
        y[r] = __fadd_rn(y[r], __fmul_rn(sn[r][i], qc[i]));
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        y[r] = __fadd_rn(y[r], __shfl_xor_sync(FULL, y[r], off));
      }
    }
    const size_t tok = ((size_t)b * T + t) * H + h;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (lane == r) {  // every lane holds every sum
        y_out[tok * D + row0 + r] = static_cast<InT>(y[r]);
      }
      if (live) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          s[r][i] = sn[r][i];
        }
      }
    }
    if constexpr (STEPS > 0) {
      if (t < STEPS) {  // history [B, STEPS, H, D, D]
        const size_t at = ((((size_t)b * STEPS + t) * H + h) * D + row0) * D;
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int i = 0; i < PER; ++i) {
            if (e0 + i < D) {
              states[at + (size_t)r * D + e0 + i] = s[r][i];
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (e0 + i < D) {
        state_out[srow + (size_t)r * D + e0 + i] = s[r][i];
      }
    }
  }
"""

INPUTS = ["q", "k", "v", "g", "beta", "state_in", "mask", "sizes"]
OUTPUTS = ["y_out", "state_out", "states"]
KERNEL = dict(name="glm53_exact_kda_prefill", inputs=INPUTS, outputs=OUTPUTS, cuda=(CUDA_SOURCE, ""))


def unsupported(q, k, v, g, beta, state, mask, state_steps) -> Optional[str]:
    """Why the kernel does not cover ``gated_delta_ops(q, k, v, g, beta, state, mask, state_steps)``, or None."""
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4:
        return "shape"
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if v.shape[:2] != (B, T) or Hv != Hk:
        return "grouped heads" if v.shape[:2] == (B, T) and Hv != Hk else "shape"
    if g.shape != (B, T, Hv, Dk):
        return "scalar gate" if g.shape == (B, T, Hv) else "shape"
    if beta.shape != (B, T, Hv):
        return "shape"
    if Dv != Dk or Dk % 8 or not 8 <= Dk <= MAX_HEAD_DIM:
        return "head dim"
    if T < 2:
        return "length"
    if state_steps is not None and not 0 < state_steps <= T:
        return "state_steps"  # stock's loop raises or returns what it returns; the kernel does not guess
    if any(x.dtype not in _FLOATS for x in (q, k, v, g, beta)):
        return "dtype"
    if state is not None and (state.dtype != mx.float32 or state.shape != (B, Hv, Dv, Dk)):
        return "state"
    if mask is not None and (mask.dtype != mx.bool_ or mask.shape != (B, T)):
        return "mask"
    return None


def looped_gated_delta(q, k, v, g, beta, state, mask=None, state_steps=None, *, fma_state=None):
    """``gated_delta_ops``'s result, (y, state) or (y, state, states), in one CUDA launch; check ``unsupported`` first."""
    B, T, H, D = q.shape
    if state is None:
        state = mx.zeros((B, H, D, D), dtype=mx.float32)
    has_mask = mask is not None
    steps = state_steps or 0
    warps = B * H * (D // ROWS_PER_WARP)
    y, state, states = gpu_kernel(backend="cuda", **KERNEL)(
        inputs=[q, k, v, g, beta, state, mask if has_mask else mx.ones((1,), dtype=mx.bool_),
                mx.array([T, warps], dtype=mx.int64)],
        template=[("InT", q.dtype), ("H", H), ("D", D),
                  ("FMA_STATE", int(DEFAULT_FMA_STATE if fma_state is None else fma_state)),
                  ("HAS_MASK", has_mask), ("STEPS", steps)],
        grid=(warps * 32, 1, 1),  # MLX rounds up to whole blocks; the extra warps return at once
        threadgroup=(min(THREADS, warps * 32), 1, 1),
        output_shapes=[(B, T, H, D), (B, H, D, D), (B, max(steps, 1), H, D, D) if steps else (1,)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )
    return (y, state, states) if steps else (y, state)


def cuda_here() -> bool:
    return gpu_backend() == "cuda"
