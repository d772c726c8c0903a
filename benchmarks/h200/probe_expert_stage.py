"""Are the routed experts' loads what holds the kernel back? (issue 17, a probe)

routed_experts' kernel (s37) brings each warp's weights through registers,
``AHEAD`` steps of 128 bytes a row at a time, and hands them to the MMA lanes
through shared memory. s39 cut its instructions per MMA from about 26 to 14
and it ran no faster (probe_expert_mma.py with ``--baseline``), and 1 or 3
steps ahead are no faster than 2: so neither issue slots nor, by that
measure, bytes in flight explain the 9-12 us a call spends beyond its loads.

This probe keeps the kernel's arithmetic (the same MMA chain, the same bf16
pair dequantization, the input in row 0) and changes only how the bytes
arrive: ``cp.async`` copies, each warp's rows ``SB`` bytes at a time (a
contiguous run per row: 16 lanes cover 256 bytes), straight into a ring of
``STAGES`` slots in shared memory, with their scales and biases; the MMA
lanes read a slot once its copies have landed. No registers hold loads in
flight, so ``STAGES - 1`` slots per warp stream while the chain runs.
Every arm is checked bit for bit against ``mx.gather_qmm`` and timed beside
stock and the patch's kernel (probe_expert_mma.py's pool and timing).
s39 (an H100): every setting bit-identical and none faster than the patch's
kernel (routed_experts' PATCH.md).

Usage: python probe_expert_stage.py [--out FILE.json]   (CUDA only)
"""

from probe_expert_mma import compare, launch, main, one, pool_of, stock  # the same experts, routes, timing, output


# Template constants: K, N, PER_ROW (as the patch's kernel), WARPS, SB (bytes of a row per slot: 256 or 512),
# STAGES (slots per warp), EARLY (1: the first copies are issued before the block lays out the input).
SOURCE = r"""
  const int lane = threadIdx.x & 31, warp_in_block = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int r = blockIdx.y;
  const int n0 = (blockIdx.x * WARPS + warp_in_block) * 8;
  constexpr int GROUPS = K / 64, SG = SB / 32, SLOTS_K = K / 2 / SB;  // groups per slot, slots per row
  constexpr int RS = SB / 16 + 1;              // a slot's row in uint4s, with 16 bytes of padding
  constexpr int SP = SG * 2 / 16;              // a row's scales (or biases) in a slot, in uint4s
  constexpr int SLOT = 8 * RS + 2 * 8 * SP;    // weights, then scales, then biases
  __shared__ uint4 xs[GROUPS * 4 * 2];         // the input as the patch's kernel lays it out
  __shared__ uint4 ring[WARPS][STAGES * SLOT];
  const size_t row0 = (size_t)idx[r] * N + n0;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w) + row0 * (K / 2);
  const uint8_t* sb = reinterpret_cast<const uint8_t*>(scales) + row0 * GROUPS * 2;
  const uint8_t* bb = reinterpret_cast<const uint8_t*>(biases) + row0 * GROUPS * 2;
  uint4* mine = ring[warp_in_block];
  auto copy16 = [](uint4* to, const uint8_t* from) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(to);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(from));
  };
  auto issue = [&](int slot_k) {  // slot_k's bytes of the warp's 8 rows, and their scales and biases
    if (slot_k < SLOTS_K) {
      uint4* slot = mine + (slot_k % STAGES) * SLOT;
      for (int i = lane; i < 8 * (SB / 16); i += 32) {
        const int rr = i / (SB / 16), cc = i % (SB / 16);
        copy16(slot + rr * RS + cc, wb + (size_t)rr * (K / 2) + (size_t)slot_k * SB + cc * 16);
      }
      if (lane < 8 * SP) {
        const int rr = lane / SP, cc = lane % SP;
        copy16(slot + 8 * RS + rr * SP + cc, sb + (size_t)rr * GROUPS * 2 + slot_k * SG * 2 + cc * 16);
        copy16(slot + 8 * RS + 8 * SP + rr * SP + cc, bb + (size_t)rr * GROUPS * 2 + slot_k * SG * 2 + cc * 16);
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  const bool active = n0 < N;
  if (EARLY && active) {  // the first slots' copies in flight while the block lays out the input
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      issue(s);
    }
  }
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x) + (size_t)(r / PER_ROW) * (K / 2);
  uint32_t* xw = reinterpret_cast<uint32_t*>(xs);
  for (int i = threadIdx.x; i < K / 2; i += blockDim.x) {
    const int group = i / 32, tt = (i / 8) % 4, j = i % 8;
    xw[i] = xr[group * 32 + (j / 2) * 8 + tt + 4 * (j % 2)];
  }
  __syncthreads();
  if (!active) {
    return;
  }
  if (!EARLY) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      issue(s);
    }
  }
  float d[4] = {};
#pragma unroll 1
  for (int s = 0; s < SLOTS_K; ++s) {
    __syncwarp();  // every lane is done with the slot the next copies overwrite
    issue(s + STAGES - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
    __syncwarp();  // and every lane's copies of slot s have landed
    const uint4* slot = mine + (s % STAGES) * SLOT;
    const unsigned short* ss = reinterpret_cast<const unsigned short*>(slot + 8 * RS) + g * SG;
    const unsigned short* zs = reinterpret_cast<const unsigned short*>(slot + 8 * RS + 8 * SP) + g * SG;
#pragma unroll
    for (int q = 0; q < SG; ++q) {
      const int group = s * SG + q;
      const uint4 lo = slot[g * RS + 2 * q], hi = slot[g * RS + 2 * q + 1];
      const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      const __nv_bfloat16 sg = __ushort_as_bfloat16(ss[q]), zg = __ushort_as_bfloat16(zs[q]);
      const uint4 xa = xs[(group * 4 + t) * 2], xb = xs[(group * 4 + t) * 2 + 1];
      const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t a0 = g == 0 ? xv[2 * c] : 0u, a2 = g == 0 ? xv[2 * c + 1] : 0u;
        const uint32_t q0 = (words[2 * c] >> (8 * t)) & 0xff, q1 = (words[2 * c + 1] >> (8 * t)) & 0xff;
        const __nv_bfloat162 base = __floats2bfloat162_rn(128.f, 128.f);
        const __nv_bfloat162 s2 = __bfloat162bfloat162(sg), z2 = __bfloat162bfloat162(zg);
        uint32_t p0 = 0x43004300u | (q0 & 15) | ((q0 >> 4) << 16), p1 = 0x43004300u | (q1 & 15) | ((q1 >> 4) << 16);
        __nv_bfloat162 v0 = __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&p0), base), s2, z2);
        __nv_bfloat162 v1 = __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&p1), base), s2, z2);
        const uint32_t b0 = *reinterpret_cast<uint32_t*>(&v0), b1 = *reinterpret_cast<uint32_t*>(&v1);
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
      }
    }
  }
  if (g == 0) {
    out[(size_t)r * N + n0 + 2 * t] = __float2bfloat16_rn(d[0]);
    out[(size_t)r * N + n0 + 2 * t + 1] = __float2bfloat16_rn(d[1]);
  }
"""

STAGED = dict(name="glm53_probe_expert_stage", inputs=["x", "w", "scales", "biases", "idx"], outputs=["out"],
              cuda=(SOURCE, None))
# (warps, bytes of a row per slot, slots, first copies before the input's layout): each within the 48 KB of
# static shared memory at K = 4096
SETTINGS = [(4, 256, 2, 1), (4, 256, 3, 0), (4, 256, 3, 1), (4, 256, 4, 1), (8, 256, 2, 1), (4, 512, 2, 1),
            (2, 512, 3, 1)]


def staged(*operands, warps, sb, stages, early):
    return launch(STAGED, *operands, warps=warps, settings=[("SB", sb), ("STAGES", stages), ("EARLY", early)])


def probe(label, n, k, routes):
    pool, per_route = pool_of(n, k, routes)
    arms = {"stock": stock, "kernel": one}
    for warps, sb, stages, early in SETTINGS:
        arms[f"staged {warps}w {sb}B x{stages}{' early' if early else ''}"] = (
            lambda *a, warps=warps, sb=sb, stages=stages, early=early: staged(*a, warps=warps, sb=sb, stages=stages,
                                                                             early=early))
    return compare(label, n, k, routes, arms, pool, per_route)


if __name__ == "__main__":
    main(probe, "probe_expert_stage")
