"""C++ stand-ins for GPU built-ins, so a kernel body can run on the host with g++.

Used by the patches' ``host_check.py`` programs, which paste a CUDA or Metal
kernel body, unchanged, into a C++ function and run every warp (simdgroup) as
32 host threads. ``__shfl_xor_sync``, ``__ballot_sync`` and ``simd_sum`` exchange real values
through a barrier, so a lane missing from a shuffle hangs (the callers time
out). bf16 is its 16-bit pattern: widened exactly to float, narrowed to
nearest even. ``load<T>(path, n)`` reads an input the Python side wrote;
``build_and_run`` compiles such a program and runs it on the input files.

Two ways to run a kernel. One warp at a time: the program starts 32 threads
and points ``warp_barrier`` at a barrier of 32. A whole block of several
warps: ``run_blocks(blocks, threads, fn)`` runs ``fn`` as every thread of
each block in turn, with a barrier per warp for the warp built-ins and one
for the block's ``__syncthreads``; ``__shared__`` arrays are function
statics, shared by the block's threads (blocks run one after another).
"""

import subprocess
import time

PRELUDE = r"""
#include <barrier>
#include <cmath>  // ::expf, as CUDA's float expf
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

struct dim3_ { unsigned x, y, z; };
thread_local dim3_ blockIdx, blockDim, threadIdx;
static std::barrier<>* warp_barrier;  // one warp at a time: its 32 threads
struct Block {  // run_blocks: all the warps of a block at once
  std::deque<std::barrier<>> warps;  // one per warp, for the warp built-ins
  std::barrier<> all;                // __syncthreads
  explicit Block(unsigned threads) : all(threads) {
    for (unsigned w = 0; w < threads / 32; ++w) warps.emplace_back(32);
  }
};
static Block* block;
inline void warp_sync() { (block ? block->warps[threadIdx.x / 32] : *warp_barrier).arrive_and_wait(); }
// Exchange slots, one per thread of a block: a warp uses its 32.
static float exchange[1024];
static uint32_t exchange_bits[1024];
inline unsigned warp_base() { return threadIdx.x & ~31u; }

struct bf16 {  // bfloat16 as its 16 bits: widened exactly, narrowed to nearest even
  uint16_t bits;
  bf16() = default;
  explicit bf16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
using __nv_bfloat16 = bf16;
using bfloat16_t = bf16;

// CUDA device functions, with the semantics the kernels rely on.
float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
template <typename V>  // float or int: 32-bit values
V __shfl_xor_sync(unsigned, V v, int offset) {
  static_assert(sizeof(V) == 4, "32-bit shuffles only");
  unsigned lane = threadIdx.x % 32;
  std::memcpy(&exchange_bits[warp_base() + lane], &v, 4);
  warp_sync();
  V other;
  std::memcpy(&other, &exchange_bits[warp_base() + (lane ^ offset)], 4);
  warp_sync();
  return other;
}
unsigned __ballot_sync(unsigned, bool predicate) {
  unsigned lane = threadIdx.x % 32;
  exchange_bits[warp_base() + lane] = predicate ? 1u : 0u;
  warp_sync();
  unsigned mask = 0;
  for (int i = 0; i < 32; ++i) mask |= exchange_bits[warp_base() + i] << i;
  warp_sync();
  return mask;
}
void __syncthreads() {
  if (!block) { std::fprintf(stderr, "__syncthreads outside run_blocks\n"); std::exit(2); }
  block->all.arrive_and_wait();
}
#define __shared__ static
int __popc(unsigned x) { return __builtin_popcount(x); }
unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// Metal.
#define device
#define constant
typedef unsigned long ulong;
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
namespace metal {
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float simd_sum(float v) {
  unsigned lane = threadIdx.x % 32;
  exchange[warp_base() + lane] = v;
  warp_sync();
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += exchange[warp_base() + i];
  warp_sync();
  return s;
}
}

// Runs fn() as every thread of `blocks` blocks of `threads` threads (a
// multiple of 32, at most 1024), one block after another.
template <typename F>
void run_blocks(unsigned blocks, unsigned threads, F fn) {
  Block b(threads);
  block = &b;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (unsigned row = 0; row < blocks; ++row) {
        blockIdx = {row, 0, 0};
        blockDim = {threads, 1, 1};
        threadIdx = {t, 0, 0};
        fn();
        b.all.arrive_and_wait();  // the next block starts once every thread has left this one
      }
    });
  }
  for (auto& th : pool) th.join();
  block = nullptr;
}

template <typename X>
std::vector<X> load(const char* path, size_t n) {
  std::vector<X> a(n);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(a.data(), sizeof(X), n, f) != n) { std::fprintf(stderr, "read %s\n", path); std::exit(2); }
  std::fclose(f);
  return a;
}
"""


def build_and_run(folder, source, args, timeout):
    """Compile ``source`` (PRELUDE + a program) with g++ in ``folder``, run it with ``args``; the run's seconds."""
    cpp, binary = folder / "body.cpp", folder / "body"
    cpp.write_text(source)
    subprocess.run(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-o", str(binary), str(cpp)], check=True)
    start = time.perf_counter()
    subprocess.run([str(binary), *map(str, args)], check=True, timeout=timeout)
    return time.perf_counter() - start
