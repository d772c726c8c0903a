"""The KDA gated delta rule over a whole prefill chunk in one CUDA launch.

Stock prefill on CUDA runs ``gated_delta_ops``: a Python loop launching one
compiled step per token, each streaming the whole [B, H, Dv, Dk] float32
state through memory. On Metal stock has a fused kernel instead; this is the
CUDA counterpart, written here (``mx.fast.cuda_kernel``, compiled by NVRTC
on first use).

For q, k [B, T, H, Dk], v [B, T, H, Dv], log decay g [B, T, H, Dk]
(float32), beta [B, T, H], state [B, H, Dv, Dk] (float32) and an optional
bool mask [B, T], token by token:

    if mask[b, t]:  S = S diag(exp g_t);  delta = beta_t (v_t - S k_t);
                    S += delta k_t^T;     y_t = S q_t
    else:           y_t = 0, S unchanged

Layout: one warp per (b, h, RPW dv rows), RPW = 4 at Dk = 128 (2 at 256,
fewer when Dv is not divisible; ``rows_per_warp``); the rows' Dk floats of
state live in registers (Dk / 32 per lane and row, lane ``l`` owning columns
``l, l + 32, ...`` so the q/k/g loads of a warp are coalesced). The rows of
a warp share each token's q/k/g loads and exps, and their butterfly sums
(``__shfl_xor_sync``) for ``S k`` and ``S q`` interleave. The loop over T runs
inside the kernel, and each token's inputs are loaded one token ahead so the
loads overlap the previous token's reductions. Blocks are 4 warps (no shared
memory, no block synchronisation). Accumulation is float32; y is written
in q's dtype (as ``chunked_gated_delta`` and stock's ``gated_delta_ops``),
the final state in float32.

``kernel_gated_delta`` takes ``chunked_gated_delta``'s arguments and returns
its (y, state), or None for what the kernel does not cover (``unsupported``
says why); the caller then runs the chunked path.

Not verified on a GPU where written (no GPU there): ``host_check.py`` runs the
body as C++ on the host against a float64 reference; ``device_check.py`` is
the H200 check.
"""

from typing import Optional

import mlx.core as mx

from glm53_patches.backend import gpu_backend
from glm53_patches.kernels.build import gpu_kernel

MAX_DK = 256  # 8 floats of state per lane and row; wider rows would spill registers
_MAX_THREADS = 2**31 - 1  # MLX takes the grid as int
THREADS = 128  # per block: 4 warps (no shared memory or block sync: blocks are just warp batches)
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)

# Template constants: InT (q/k/v/y dtype), H, Dk, Dv, RPW (dv rows per warp),
# HAS_MASK. Offsets in 64 bits: B * T * H * Dk exceeds 2^31 at long prompts.
CUDA_SOURCE = r"""
  constexpr int NPER = Dk / 32;  // key columns per lane
  constexpr unsigned FULL = 0xffffffffu;
  const long long T = sizes[0];
  const long long warps = sizes[1];  // B * H * (Dv / RPW)
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = (int)(threadIdx.x % 32);
  if (warp >= warps) {  // whole warps leave: the grid is rounded up to whole blocks
    return;
  }
  const int row0 = (int)(warp % (Dv / RPW)) * RPW;  // this warp's dv rows: row0 .. row0 + RPW - 1
  const long long bh = warp / (Dv / RPW);  // b * H + h
  const long long b = bh / H;
  const int h = (int)(bh % H);

  // state rows [B, H, Dv, Dk]: this warp's RPW rows are contiguous
  const size_t srow = ((size_t)bh * Dv + row0) * Dk;
  float s[RPW][NPER];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
#pragma unroll
    for (int i = 0; i < NPER; ++i) {
      s[r][i] = state_in[srow + (size_t)r * Dk + lane + 32 * i];
    }
  }

  // Token t of this (b, h): q/k/g rows at ((b T + t) H + h) Dk, v/y rows at
  // ((b T + t) H + h) Dv, beta at (b T + t) H + h, mask at b T + t.
  const size_t tok0 = (size_t)b * T * H + h;  // (b T + 0) H + h
  float kc[NPER], qc[NPER], dc[NPER], kn[NPER], qn[NPER], dn[NPER];
  float vc[RPW], vn[RPW];
  float bc = 0.0f, bn = 0.0f;
  bool mc = true, mn = true;
  // Loads token `tok` (index t) into the *n registers.
  auto load = [&](size_t tok, long long t) {
    const size_t base = tok * Dk;
#pragma unroll
    for (int i = 0; i < NPER; ++i) {
      kn[i] = static_cast<float>(k[base + lane + 32 * i]);
      qn[i] = static_cast<float>(q[base + lane + 32 * i]);
      dn[i] = expf(g[base + lane + 32 * i]);
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      vn[r] = static_cast<float>(v[tok * Dv + row0 + r]);
    }
    bn = beta[tok];
    if constexpr (HAS_MASK) {
      mn = mask[(size_t)b * T + t];
    }
  };
  if (T > 0) {
    load(tok0, 0);
  }
  for (long long t = 0; t < T; ++t) {
    const size_t tok = tok0 + (size_t)t * H;
#pragma unroll
    for (int i = 0; i < NPER; ++i) {
      kc[i] = kn[i];
      qc[i] = qn[i];
      dc[i] = dn[i];
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      vc[r] = vn[r];
    }
    bc = bn;
    mc = mn;
    if (t + 1 < T) {  // prefetch the next token while this one reduces
      load(tok + H, t + 1);
    }
    float out[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      out[r] = 0.0f;
    }
    if (mc) {  // the same for all lanes: the shuffles see the whole warp
      float kv[RPW];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        kv[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < NPER; ++i) {
          s[r][i] *= dc[i];
          kv[r] += s[r][i] * kc[i];
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          kv[r] += __shfl_xor_sync(FULL, kv[r], offset);
        }
      }
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float delta = (vc[r] - kv[r]) * bc;
#pragma unroll
        for (int i = 0; i < NPER; ++i) {
          s[r][i] += kc[i] * delta;
          out[r] += s[r][i] * qc[i];
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          out[r] += __shfl_xor_sync(FULL, out[r], offset);
        }
      }
    }
    if (lane < RPW) {  // lane r writes row r (every lane holds every sum)
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        if (lane == r) {
          y[tok * Dv + row0 + r] = static_cast<InT>(out[r]);  // masked: 0
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
#pragma unroll
    for (int i = 0; i < NPER; ++i) {
      state_out[srow + (size_t)r * Dk + lane + 32 * i] = s[r][i];
    }
  }
"""

INPUT_NAMES = ["q", "k", "v", "g", "beta", "state_in", "mask", "sizes"]
OUTPUT_NAMES = ["y", "state_out"]
KERNEL = dict(name="glm53_kda_prefill", inputs=INPUT_NAMES, outputs=OUTPUT_NAMES, cuda=(CUDA_SOURCE, ""))


def cuda_available() -> bool:
    """The default device is a CUDA GPU."""
    return gpu_backend() == "cuda"


def rows_per_warp(dk: int, dv: int) -> int:
    """dv rows per warp: 4 (or 2) when Dv allows and the state stays at <= 16 registers per lane.

    A warp's rows share one load (and exp) of q, k and g per token, and their
    reductions interleave; at 64 heads x 128 this makes 2048 warps, all
    resident on an H200 at once.
    """
    for rows in (4, 2, 1):
        if dv % rows == 0 and rows * (dk // 32) <= 16:
            return rows
    return 1


def unsupported(q, k, v, log_g, beta, state, mask) -> Optional[str]:
    """Why the kernel does not cover these inputs, or None when it does (backend not checked)."""
    if q.ndim != 4 or k.shape != q.shape or log_g.shape != q.shape:
        return "shape"
    B, T, H, Dk = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        return "shape"
    Dv = v.shape[3]
    if Dk == 0 or Dk % 32 or Dk > MAX_DK:
        return "key dim (multiple of 32 up to 256)"
    if B * T * H * Dv == 0:
        return "empty"
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        return "dtype"
    if state is not None and state.shape != (B, H, Dv, Dk):
        return "state shape"
    if mask is not None and (mask.shape != (B, T) or mask.dtype != mx.bool_):
        return "mask"
    if B * H * Dv * 32 + THREADS > _MAX_THREADS:
        return "grid"
    return None


def kernel_gated_delta(q, k, v, log_g, beta, state, mask=None, chunk=None, sub=None, segment=None, verbose=False):
    """``chunked_gated_delta`` in one CUDA launch: (y, state), or None where not covered.

    ``chunk``, ``sub`` and ``segment`` are the chunked path's tuning and are
    ignored (accepted so the two are interchangeable at the call site).
    ``verbose`` prints MLX's generated kernel source (diagnosis).
    """
    if not cuda_available() or unsupported(q, k, v, log_g, beta, state, mask) is not None:
        return None
    B, T, H, Dk = q.shape
    Dv = v.shape[3]
    f32 = mx.float32
    if state is None:
        state = mx.zeros((B, H, Dv, Dk), dtype=f32)
    has_mask = mask is not None
    if not has_mask:
        mask = mx.zeros((1,), dtype=mx.bool_)  # unread placeholder
    rows = rows_per_warp(Dk, Dv)
    warps = B * H * (Dv // rows)
    y, state = gpu_kernel(backend="cuda", **KERNEL)(
        inputs=[
            q, k, v, log_g.astype(f32), beta.astype(f32), state.astype(f32), mask,
            mx.array([T, warps], dtype=mx.int64),
        ],
        template=[("InT", q.dtype), ("H", H), ("Dk", Dk), ("Dv", Dv), ("RPW", rows), ("HAS_MASK", has_mask)],
        grid=(warps * 32, 1, 1),  # MLX rounds up to whole blocks; the extra warps return at once
        threadgroup=(min(THREADS, warps * 32), 1, 1),
        output_shapes=[(B, T, H, Dv), (B, H, Dv, Dk)],
        output_dtypes=[q.dtype, f32],
        verbose=verbose,
    )
    return y, state


def clear():
    global _kernel
    _kernel = None
