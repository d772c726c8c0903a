"""Chunked (WY / UT-transform) KDA prefill: the gated delta rule with matmuls.

Stock prefill off Metal runs ``gated_delta_ops``: one compiled step per token
in a Python loop, each step streaming the whole [B, H, Dv, Dk] state several
times. Here the sequence is cut into chunks of C tokens. Inside a chunk the
recurrence (S: [Dv, Dk], per-key-dim decay g_t, write strength beta_t)

    S_t = S_{t-1} diag(g_t) + delta_t k_t^T,
    delta_t = beta_t (v_t - S_{t-1} diag(g_t) k_t),      y_t = S_t q_t

unrolls, with G_t = sum_{i<=t} log g_i (per key dim, from the chunk start) and
Delta the rows delta_t, into

    (I + A) Delta = beta V - beta (K e^G) S_0^T,  A[t,i] = beta_t sum_d k_td k_id e^(G_td - G_id), i < t
    Y = (Q e^G) S_0^T + M Delta,                  M[t,i] = sum_d q_td k_id e^(G_td - G_id),        i <= t
    S_C^T = e^(G_C) S_0^T + (K e^(G_C - G))^T Delta

so the state-independent parts (A, M, (I + A)^-1, its products with V and
K e^G) are batched matmuls over every chunk at once, and only a short scan
over chunks (three [C, Dk] x [Dk, Dv] matmuls each) stays sequential.

e^(G_t - G_i) is never formed pairwise ([C, C, Dk] exps per chunk would cost
more than the stock loop); it is factored around the end of i's sub-block of
S tokens (see ``_intra``) so that the only exp of a positive number is
e^(|lower_bound| S) at most, kept finite in float32 by the choice of S
(``sub_block``). This is why the patch needs KDA's safe gate
(log g > lower_bound): without a bound no sub-block size is safe, and the
mixer leaves such layers to stock.

Everything is computed in float32, as stock does (its float32 state promotes
bf16 inputs); y is cast back to the input dtype.
"""

import functools
import math

import mlx.core as mx

# Largest exponent allowed in a query-side factor: e^80 ~ 5.5e34 and the
# products with key factors (>= e^-80) stay inside float32's range.
_MAX_EXPONENT = 80.0


def sub_block(chunk, lower_bound):
    """Largest power of two S <= min(chunk, 16) with |lb| S <= 80, or None."""
    size = 1 << min(4, int(math.log2(chunk)))
    while size > 1 and abs(lower_bound) * size > _MAX_EXPONENT:
        size //= 2
    return size if size > 1 and chunk % size == 0 else None


def log_gate(A_log, a, dt_bias, lower_bound):
    """log of stock ``compute_g_safe``: the same expression without the final exp."""
    return lower_bound * mx.sigmoid(mx.exp(A_log.astype(mx.float32)) * (a + dt_bias))


def _unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by forward substitution.

    Row t of the inverse is e_t - A[t, :t] X[:t]; rows are built C at a time
    over every batch, head and chunk at once (C small ops, not C * chunks).
    """
    C = A.shape[-1]
    eye = mx.eye(C, dtype=A.dtype)
    rows = [mx.broadcast_to(eye[0], A.shape[:-2] + (C,))]
    for t in range(1, C):
        X = mx.stack(rows, axis=-2)  # [..., t, C]
        rows.append(eye[t] - (A[..., t : t + 1, :t] @ X)[..., 0, :])
    return mx.stack(rows, axis=-2)


def _tri_inverse(A):
    """(I + A)^-1 via LAPACK trtri on the CPU stream (batched)."""
    C = A.shape[-1]
    return mx.linalg.tri_inv(A + mx.eye(C, dtype=A.dtype), upper=False, stream=mx.cpu)


@functools.lru_cache(maxsize=None)
def _masks(C, S):
    rows = mx.arange(C)
    blocks = mx.arange(C // S)
    # F[p, q] is only needed for key sub-block q at or before row sub-block p.
    kept = (blocks[:, None] >= blocks[None, :])[..., None, None]
    strict = rows[:, None] > rows[None, :]
    lower = rows[:, None] >= rows[None, :]
    return kept, strict, lower


def _intra(q, k, v, log_g, beta, S):
    """State-independent chunk quantities. Inputs [..., C, D] float32 (beta [..., C, 1]).

    Returns WQ = [W; Q e^G] (so one matmul with the chunk's start state gives
    both W S0^T and (Q e^G) S0^T), U, M, e^(G_C) [..., Dk, 1] and
    (K e^(G_C - G))^T [..., Dk, C]; Delta = U - W S0^T.

    Decays are factored hierarchically so every exp is of a non-positive
    number except one per sub-block: for row r in sub-block p and key i in
    sub-block q <= p,
        e^(G_r - G_i) = e^(Gl_r) * e^(Bprev_p - Bend_q) * e^(Gl_end(q) - Gl_i)
    with Gl the cumulative log decay inside a sub-block, Bprev_p / Bend_q the
    chunk-level sums before p / through q. The middle factor is > 1 only for
    q == p, where it is e^(-Gl_end(p)) <= e^(|lower_bound| S) (see sub_block).
    """
    C, Dk = k.shape[-2:]
    nb = C // S
    kept, strict, lower = _masks(C, S)
    batch = k.shape[:-2]

    def blocked(x):  # [..., C, D] -> [..., nb, S, D]
        return x.reshape(*batch, nb, S, x.shape[-1])

    Gl = mx.cumsum(blocked(log_g), axis=-2)  # [..., nb, S, Dk], <= 0
    Ge = Gl[..., -1:, :]  # [..., nb, 1, Dk]: each sub-block's total
    eGl = mx.exp(Gl)  # decay from the sub-block start through the token
    eKey = mx.exp(Ge - Gl)  # decay after the token to its sub-block end
    Bend = mx.cumsum(Ge, axis=-3)  # chunk-level G at each sub-block end
    Bprev = Bend - Ge  # ... and before each sub-block
    F = mx.exp(mx.where(kept, Bprev[..., :, None, :, :] - Bend[..., None, :, :, :], -mx.inf))
    KnT = (blocked(k) * eKey).swapaxes(-1, -2)[..., None, :, :, :]  # [..., 1, nb, Dk, S]

    def pairs(x):  # sum_d x_rd e^(G_rd - G_id) k_id for all r, i: [..., C, C]
        xf = (blocked(x) * eGl)[..., :, None, :, :] * F  # [..., nb(p), nb(q), S, Dk]
        return (xf @ KnT).swapaxes(-3, -2).reshape(*batch, C, C)

    A = mx.where(strict, beta * pairs(k), 0.0)
    M = mx.where(lower, pairs(q), 0.0)
    if mx.default_device() == mx.cpu:
        T = _tri_inverse(A)
    else:
        T = _unit_lower_inverse(A)
    eG = (mx.exp(Bprev) * eGl).reshape(*batch, C, Dk)  # e^(G_r), chunk level
    eTail = (mx.exp(Bend[..., -1:, :, :] - Bend) * eKey).reshape(*batch, C, Dk)  # e^(G_C - G_r)
    W = T @ (beta * k * eG)
    U = T @ (beta * v)
    decay = mx.exp(Bend[..., -1, :, :]).swapaxes(-1, -2)  # [..., Dk, 1]
    return mx.concatenate([W, q * eG], axis=-2), U, M, decay, (k * eTail).swapaxes(-1, -2)


@mx.compile
def _scan_step(WQ, U, M, decay, KdT, St):
    """One chunk of the scan; St is the state transposed, [..., Dk, Dv]."""
    P = WQ @ St
    C = U.shape[-2]
    delta = U - P[..., :C, :]
    y = P[..., C:, :] + M @ delta
    return y, decay * St + KdT @ delta


def chunked_gated_delta(q, k, v, log_g, beta, state, mask=None, chunk=64, sub=16, segment=1024):
    """The gated delta rule over a whole prompt, chunk by chunk.

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; log_g: [B, T, H, Dk] (log of the
    per-key-dim decay); beta: [B, T, H]; state: [B, H, Dv, Dk] or None;
    mask: [B, T] bool or None. Masked tokens leave the state untouched (as
    stock's ``mx.where(mask, new, old)``: decay 1, write 0) and output 0 (as
    stock's Metal kernel). Returns y [B, T, H, Dv] in q's dtype and the
    float32 state. The prompt is processed ``segment`` tokens at a time to
    bound the memory of the batched intra-chunk tensors.
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    out_dtype = q.dtype
    f32 = mx.float32
    q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    log_g, beta = log_g.astype(f32), beta.astype(f32)
    if mask is not None:
        log_g = mx.where(mask[:, :, None, None], log_g, 0.0)
        beta = mx.where(mask[:, :, None], beta, 0.0)
    if state is None:
        St = mx.zeros((B, H, Dk, Dv), dtype=f32)
    else:
        St = state.astype(f32).swapaxes(-1, -2)
    C = chunk
    pad = -T % C
    if pad:  # padded tokens: q = k = v = 0, decay 1, write 0
        widths = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, v, log_g = (mx.pad(x, widths) for x in (q, k, v, log_g))
        beta = mx.pad(beta, widths[:3])
    N = (T + pad) // C

    def split(x):  # [B, T, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, C, H, x.shape[-1]).transpose(0, 3, 1, 2, 4)

    q, k, v, log_g = split(q), split(k), split(v), split(log_g)
    beta = split(beta[..., None])
    per_segment = max(1, segment // C)
    ys = []
    for s in range(0, N, per_segment):
        part = slice(s, min(N, s + per_segment))
        WQ, U, M, decay, KdT = _intra(q[:, :, part], k[:, :, part], v[:, :, part], log_g[:, :, part], beta[:, :, part], sub)
        n_part = WQ.shape[2]
        for n in range(n_part):
            y, St = _scan_step(WQ[:, :, n], U[:, :, n], M[:, :, n], decay[:, :, n], KdT[:, :, n], St)
            ys.append(y)
        if part.stop < N:  # free this segment's intra-chunk tensors before the next
            mx.eval(St, *ys[-n_part:])
    y = mx.stack(ys, axis=2)  # [B, H, N, C, Dv]
    y = y.transpose(0, 2, 3, 1, 4).reshape(B, N * C, H, Dv)[:, :T]
    if mask is not None:
        y = mx.where(mask[:, :, None, None], y, 0.0)
    return y.astype(out_dtype), St.swapaxes(-1, -2)
