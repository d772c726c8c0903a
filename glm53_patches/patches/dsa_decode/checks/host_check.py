"""Run the selection kernel's body on the host: ``python -m glm53_patches.patches.dsa_decode.checks.host_check``.

The CUDA kernel's text (``select_kernel.CUDA_HEADER`` and ``CUDA_SOURCE``:
its macros around ``HELPERS`` and ``SELECT_BODY``, the body Metal shares) is
compiled unchanged into a C++ program with g++
(``glm53_patches/checks/host_emulation.py``: each block runs as one host
thread per GPU thread, with per-warp barriers for shuffles and ballots, a
block barrier for ``__syncthreads`` and ``__shared__`` arrays as statics).
Its output is compared with ``reference``, numpy's statement of what stock's
indexer returns at decode under a stable sort
(``tests/numerics/test_dsa_decode.py`` checks that reference against the
stock indexer on the CPU).

Cases: real widths (kpool 16, topk 2048, tail 15) at 4k, 33k, 66k and 131k
keys (256 to 8,192 pools, most not a multiple of the block size), with holes
in the key validity, short pool caches (one shorter than ``select_k``), a
padded query, ties at the boundary among -0 and +0, and NaN past it; small
widths with holes, a short pool cache, a padded query, ties, NaN scores, no
valid key and all pools selected, each also at 1 and 3 warps per block.
Blocks of 2 to 8 positions (speculative verify blocks): real widths at 4,100
and 33,000 keys with pool ends inside the block, left padding and padded
positions; small widths with holes, ties, NaN scores and all pools selected.
Needs g++ on PATH.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run

from .. import select_kernel

PROGRAM = r"""
#define __device__
#define __forceinline__ inline
%(header)s

template <int KPOOL, int TOPK, int TAIL, int WARPS>
void body(const float* scores, const bool* key_valid, const int* pool_limit, const bool* query_valid,
          const int* dims, int* topk) {
%(source)s
}

int main(int argc, char** argv) {
  constexpr int B = %(B)d, L = %(L)d, T = %(T)d, P = %(P)d, W = %(W)d;
  auto scores = load<float>(argv[1], B * L * P);
  auto kv_bytes = load<uint8_t>(argv[2], B * T);
  auto limit = load<int>(argv[3], B);
  auto qv_bytes = load<uint8_t>(argv[4], B * L);
  auto dims = load<int>(argv[5], 4);
  std::vector<char> kv(kv_bytes.begin(), kv_bytes.end()), qv(qv_bytes.begin(), qv_bytes.end());
  std::vector<int> out(B * L * W, -7);  // poison: every slot must be written
  run_blocks(B * L, 32 * %(WARPS)d, [&] {
    body<%(KPOOL)d, %(TOPK)d, %(TAIL)d, %(WARPS)d>(scores.data(), reinterpret_cast<const bool*>(kv.data()),
        limit.data(), reinterpret_cast<const bool*>(qv.data()), dims.data(), out.data());
  });
  FILE* f = std::fopen(argv[6], "wb");
  std::fwrite(out.data(), 4, out.size(), f);
  std::fclose(f);
  return 0;
}
"""


def reference(scores, key_valid, pool_limit, query_valid, select_k, kpool, topk, tail):
    """Stock's decode selection in numpy, its argpartition taken as a stable sort.

    scores [B, L, P], query_valid [B, L]: a decode token (L = 1) or a short block, whose keys are
    the last L of ``key_valid`` [B, T] (position i is key T - L + i and does not see the block's later
    keys). Returns [B, L, topk + tail].
    """
    batch, length, pools = scores.shape
    keys = key_valid.shape[1]
    out = np.full((batch, length, topk + tail), -1, np.int64)
    for b in range(batch):
        valid_keys = np.flatnonzero(key_valid[b])
        first = int(valid_keys[0]) if len(valid_keys) else keys
        end = np.clip(first + np.arange(pools) * kpool + kpool - 1, 0, max(keys - 1, 0))
        for i in range(length):
            if not query_valid[b, i]:
                continue
            count = len(valid_keys) - int(query_valid[b, i + 1:].sum())
            candidate = (np.arange(pools) < pool_limit[b]) & (end <= keys - length + i)
            sort_key = -np.where(candidate, scores[b, i], np.finfo(np.float32).min).astype(np.float32)
            chosen = np.argsort(sort_key, kind="stable")[:select_k]  # NaN last, -0 == 0
            pools_kept = np.sort(chosen[candidate[chosen]])
            positions = (first + pools_kept[:, None] * kpool + np.arange(kpool)).reshape(-1)
            out[b, i, : len(positions)] = positions
            tail_count = count % kpool
            t = first + count - tail_count + np.arange(tail)
            ok = (np.arange(tail) < tail_count) & (t < keys) & key_valid[b, np.clip(t, 0, max(keys - 1, 0))]
            out[b, i, topk:] = np.where(ok, t, -1)
    return out.astype(np.int32)


def cases(rng):
    """(name, scores [B, L, P], key_valid [B, T], pool_limit [B], query_valid [B, L], select_k, kpool, topk, tail,
    real): decode tokens (L = 1), then short blocks.

    ``real``: at the real widths (kpool 16, topk 2048, tail 15); the small ones also run at other block sizes.
    """
    for name, scores, key_valid, limit, query_valid, *rest in _token_cases(rng):
        yield (name, scores[:, None], key_valid, limit, query_valid[:, None], *rest)
    yield from _block_cases(rng)


def _block_cases(rng):
    """Blocks whose positions straddle pool ends (a pool whose clipped end is a later position's key is a
    candidate from that position on), with padded positions: each row's last L keys are its block."""

    def block(keys, pads, query_valid, holes=()):
        key_valid = np.arange(keys)[None] >= np.array(pads)[:, None]
        for row, start, stop in holes:
            key_valid[row, start:stop] = False
        key_valid[:, keys - query_valid.shape[1]:] &= query_valid
        return key_valid

    real = (128, 16, 2048, 15, True)
    query_valid = np.array([[True] * 4, [True, False, True, True]])
    keys, pools = 4100, 256  # the last pool ends inside the block
    yield ("real widths, a 4-token block at 4,100 keys, row 1 left-padded with a padded position",
           rng.normal(0, 1, (2, 4, pools)).astype(np.float32), block(keys, (0, 6), query_valid),
           np.array([pools, pools]), query_valid, *real)
    query_valid = np.array([[True] * 8, [True] * 6 + [False] * 2, [False] + [True] * 7])
    keys, pools = 33000, 2062
    yield ("real widths, 8-token blocks at 33,000 keys: left padding moves the pool ends into the block, holes",
           rng.normal(0, 1, (3, 8, pools)).astype(np.float32),
           block(keys, (37, 9, 0), query_valid, holes=((2, 100, 300),)), np.array([pools, pools - 2, pools]),
           query_valid, *real)

    small = (16, 4, 64, 3, False)
    query_valid = np.array([[True, True, True], [True, False, True], [False, True, True]])
    yield ("small, 3-token blocks: holes, short pool cache, padded positions",
           rng.normal(0, 1, (3, 3, 75)).astype(np.float32), block(302, (0, 5, 2), query_valid, ((2, 100, 140),)),
           np.array([75, 70, 75]), query_valid, *small)
    query_valid = np.ones((2, 8), bool)
    tied = np.repeat(rng.normal(0, 1, (2, 8, 5)), 15, axis=2).astype(np.float32)  # 15 copies of 5 values
    yield "small, 8-token blocks, ties across the boundary", tied, block(303, (0, 1), query_valid), \
        np.array([75, 75]), query_valid, *small
    query_valid = np.array([[True, True, False, True, True]])
    nan = rng.normal(0, 1, (1, 5, 75)).astype(np.float32)
    nan[0, :, 6:] = np.nan
    yield "small, a 5-token block, NaN scores", nan, block(300, (0,), query_valid), np.array([75]), query_valid, \
        *small
    query_valid = np.array([[True, True], [False, True]])
    yield "small, 2-token blocks, every pool selected", np.zeros((2, 2, 9), np.float32), \
        block(38, (0, 3), query_valid), np.array([9, 9]), query_valid, 9, 4, 64, 3, False


def _token_cases(rng):
    """Decode tokens: scores [B, P], query_valid [B]."""

    def valid_rows(batch, keys, pads):
        return np.arange(keys)[None] >= np.array(pads)[:, None]

    real = (128, 16, 2048, 15)
    for keys in (4096, 33000):  # 256 pools (one block of threads); 2,062 (not a multiple of it)
        pools = keys // 16
        scores = rng.normal(0, 1, (2, pools)).astype(np.float32)
        valid = valid_rows(2, keys, (0, 37))
        yield (f"real widths, {keys} keys, row 1 left-padded", scores, valid, np.array([pools, pools - 3]),
               np.array([True, True]), *real, True)

    keys, pools = 66000, 4125
    valid = valid_rows(3, keys, (0, 1000, 0))
    valid[0, 20000:20500] = False  # holes: fewer visible keys than positions, so the tail moves
    valid[1, keys - 9:keys - 4] = False  # a hole inside the tail
    yield (f"real widths, {keys} keys: holes, short pool cache, padded query", rng.normal(0, 1, (3, pools)).astype(
        np.float32), valid, np.array([pools, pools - 70, pools]), np.array([True, True, False]), *real, True)

    keys, pools = 131080, 8192  # the kernel's capacity, a multiple of the block size
    ties = rng.integers(-39, 1, (1, pools)).astype(np.float32)  # ~205 pools at 0, the boundary value
    ties[ties == 0] = np.where(rng.random(int((ties == 0).sum())) < 0.5, -0.0, 0.0)  # -0 == +0
    nan = rng.normal(0, 1, (1, pools)).astype(np.float32)
    nan[0, rng.permutation(pools)[60:]] = np.nan  # 60 finite scores: the 128th pick is a NaN
    valid = valid_rows(2, keys, (0, 0))
    valid[1, 50000:50033] = False
    yield (f"real widths, {keys} keys ({pools} pools): ties at the boundary with -0/+0, NaN past it",
           np.concatenate([ties, nan]), valid, np.array([pools, pools]), np.array([True, True]), *real, True)

    keys, pools = 131000, 8187
    valid = valid_rows(2, keys, (0, 300))
    valid[1, 7:4000:13] = False
    yield (f"real widths, {keys} keys ({pools} pools): a pool cache of fewer pools than select_k, holes",
           rng.normal(0, 1, (2, pools)).astype(np.float32), valid, np.array([100, pools - 5]),
           np.array([True, True]), *real, True)

    small = (16, 4, 64, 3, False)
    valid = valid_rows(3, 300, (0, 5, 0))
    valid[2, 100:140] = False  # a hole in the validity row
    yield ("small, holes, short pool cache, padded query", rng.normal(0, 1, (3, 75)).astype(np.float32), valid,
           np.array([75, 70, 72]), np.array([True, True, False]), *small)
    tied = np.repeat(rng.normal(0, 1, (2, 5)), 15, axis=1).astype(np.float32)  # 15 copies of 5 values
    yield "ties across the boundary", tied, valid_rows(2, 300, (0, 0)), np.array([75, 75]), np.array([True, True]), \
        *small
    nan = rng.normal(0, 1, (1, 75)).astype(np.float32)
    nan[0, 6:] = np.nan  # 6 finite scores: the 16th pick is a NaN
    yield "NaN scores", nan, valid_rows(1, 300, (0,)), np.array([75]), np.array([True]), *small
    yield "no valid key", rng.normal(0, 1, (1, 75)).astype(np.float32), np.zeros((1, 300), bool), np.array([75]), \
        np.array([True]), *small
    yield "every pool selected", np.zeros((2, 9), np.float32), valid_rows(2, 38, (0, 3)), np.array([9, 9]), \
        np.array([True, True]), 9, 4, 64, 3, False


def run_case(tmp, scores, key_valid, pool_limit, query_valid, select_k, kpool, topk, tail, warps):
    batch, length, pools = scores.shape
    keys = key_valid.shape[1]
    paths = [tmp / n for n in ("scores", "kv", "limit", "qv", "dims", "out")]
    inputs = (scores.astype(np.float32), key_valid.astype(np.uint8), pool_limit.astype(np.int32),
              query_valid.astype(np.uint8), np.array([keys, pools, select_k, length], np.int32))
    for path, array in zip(paths, inputs):
        array.tofile(path)
    source = PRELUDE + PROGRAM % {
        "header": select_kernel.CUDA_HEADER, "source": select_kernel.CUDA_SOURCE, "B": batch, "L": length,
        "T": keys, "P": pools, "W": topk + tail, "KPOOL": kpool, "TOPK": topk, "TAIL": tail, "WARPS": warps,
    }
    build_and_run(tmp, source, paths, timeout=300)
    got = np.fromfile(paths[-1], dtype=np.int32).reshape(batch * length, topk + tail)
    want = reference(scores, key_valid, pool_limit, query_valid, select_k, kpool, topk, tail).reshape(got.shape)
    return bool(np.array_equal(got, want)), got, want


def main():
    rng = np.random.default_rng(0)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, *case, real in cases(rng):
            for warps in (select_kernel.WARPS,) if real else (select_kernel.WARPS, 1, 3):
                ok, got, want = run_case(Path(tmp), *case, warps)
                failed += not ok
                print(f"{'ok' if ok else 'FAILED':>6}  {name} ({warps} warps)", flush=True)
                if not ok:
                    bad = np.argwhere(got != want)[:4]
                    print("   first differences (row x position, slot, got, want):",
                          [(int(r), int(c), int(got[r, c]), int(want[r, c])) for r, c in bad])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
