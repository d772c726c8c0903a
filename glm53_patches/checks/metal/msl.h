// Metal Shading Language, as far as the kernels checked here use it, for a host C++ compiler.
//
// Two modes. MSL_TYPECHECK (clang -fsyntax-only): the address spaces are clang
// address_space attributes, so a pointer without one (MSL: thread memory) does
// not take a device or constant pointer. Otherwise (g++, emulation): they are
// nothing, and the SIMD-group functions exchange real values between the
// threads of one threadgroup, run as fibers (the runtime at the end).
//
// `threadgroup` expands to a marker the harness (typecheck.py) rewrites: a
// declaration that starts with it becomes `static` (a threadgroup array is
// one per threadgroup: shared by its threads), a pointer's keeps the
// address space. `bfloat` converts as MSL 3.1 allows (quoted in MLX's
// kernels/bf16_math.h): implicitly to float only; nothing converts implicitly
// to it. For clang it is __bf16 (typecheck.py reports clang's implicit
// float -> __bf16 conversion warnings as errors) and vectors are ext_vector
// types (whose stores into device memory clang accepts; classes there it
// does not), with bf16 and half lanes as float: only the shape of vector
// code is checked. In the emulation `metal::exp` (the fast one, as under MLX's Safe math
// mode) is deliberately not `metal::precise::exp`, so a kernel that spells
// exp differently from stock computes different bits.
#pragma once

#ifndef MSL_TYPECHECK  // the emulation's own headers, before the MSL words below are macros
#ifndef MSL_STD_INCLUDED  // else the build includes msl_std.h (precompiled) ahead of the preprocessed text
#include "msl_std.h"
#endif
#endif

#ifdef MSL_TYPECHECK
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#else
#define device
#define constant
#endif
#define threadgroup __msl_threadgroup__
#define thread
#define METAL_FUNC inline

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __SIZE_TYPE__ size_t;
typedef _Float16 half;

namespace metal {
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
template <class A, class B> constexpr bool is_same_v = false;
template <class A> constexpr bool is_same_v<A, A> = true;
template <class T> constexpr bool is_integral_v =
    is_same_v<T, bool> || is_same_v<T, char> || is_same_v<T, signed char> || is_same_v<T, uchar> ||
    is_same_v<T, short> || is_same_v<T, ushort> || is_same_v<T, int> || is_same_v<T, uint> ||
    is_same_v<T, long> || is_same_v<T, ulong> || is_same_v<T, long long> || is_same_v<T, unsigned long long>;
}  // namespace metal

constexpr float __msl_bits_to_float(uint u) { return __builtin_bit_cast(float, u); }
constexpr uint __msl_float_to_bits(float f) { return __builtin_bit_cast(uint, f); }

#ifdef MSL_TYPECHECK
typedef __bf16 bfloat;
#else
// bfloat: 16 bits; widened exactly; narrowed to nearest even (NaN stays NaN).
struct bfloat {
  ushort bits;
  bfloat() = default;
  template <class U, class = metal::enable_if_t<metal::is_integral_v<U> || metal::is_same_v<U, float> ||
                                                metal::is_same_v<U, half> || metal::is_same_v<U, double>>>
  explicit constexpr bfloat(U v) : bits(narrow(float(v))) {}
  constexpr operator float() const { return __msl_bits_to_float(uint(bits) << 16); }
  template <class U> explicit operator U() const { return U(float(*this)); }
  static constexpr ushort narrow(float f) {
    uint u = __msl_float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ushort((u >> 16) | 0x40u);
    return ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

// bfloat arithmetic: bfloat with bfloat or an integer gives bfloat, with float
// gives float; with half it does not compile (neither converts to the other).
#define MSL_BF_OP(op)                                                                           \
  inline bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); }        \
  inline float operator op(bfloat a, float b) { return float(a) op b; }                         \
  inline float operator op(float a, bfloat b) { return a op float(b); }                         \
  template <class I, class = metal::enable_if_t<metal::is_integral_v<I>>>                       \
  inline bfloat operator op(bfloat a, I b) { return bfloat(float(a) op float(b)); }             \
  template <class I, class = metal::enable_if_t<metal::is_integral_v<I>>>                       \
  inline bfloat operator op(I a, bfloat b) { return bfloat(float(a) op float(b)); }             \
  void operator op(bfloat, half) = delete;                                                      \
  void operator op(half, bfloat) = delete;                                                      \
  inline bfloat& operator op##=(bfloat& a, bfloat b) { return a = a op b; }
MSL_BF_OP(+)
MSL_BF_OP(-)
MSL_BF_OP(*)
MSL_BF_OP(/)
#undef MSL_BF_OP
inline bfloat operator-(bfloat a) { bfloat r; r.bits = ushort(a.bits ^ 0x8000u); return r; }

#endif
typedef bfloat bfloat16_t;  // MLX's kernels/bf16.h
typedef half float16_t;     // MLX's kernels/utils.h

namespace metal {
template <class T> constexpr bool is_floating_point_v =
    is_same_v<T, float> || is_same_v<T, half> || is_same_v<T, bfloat>;

#ifdef MSL_TYPECHECK
template <class T> struct vec_lane { using type = T; };
template <> struct vec_lane<bfloat> { using type = float; };
template <> struct vec_lane<half> { using type = float; };
template <class T, int N> struct vec_type { typedef typename vec_lane<T>::type type __attribute__((ext_vector_type(N))); };
template <class T, int N> using vec = typename vec_type<T, N>::type;
#else
// Vectors: componentwise arithmetic, a scalar broadcasts; conversions between
// element types only explicitly.
template <class T, int N> struct vec_storage;
template <class T> struct vec_storage<T, 2> { T x, y; };
template <class T> struct vec_storage<T, 3> { T x, y, z; };
template <class T> struct vec_storage<T, 4> { T x, y, z, w; };
template <class T, int N> struct vec : vec_storage<T, N> {
  vec() = default;
  constexpr vec(T s) { for (int i = 0; i < N; ++i) (*this)[i] = s; }
  template <class... A, class = enable_if_t<sizeof...(A) == N && (N > 1)>>
  constexpr vec(A... a) { T v[N] = {T(a)...}; for (int i = 0; i < N; ++i) (*this)[i] = v[i]; }
  template <class U, class = enable_if_t<!is_same_v<U, T>>>
  explicit constexpr vec(vec<U, N> o) { for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]); }
  constexpr T& operator[](int i) { return (&this->x)[i]; }
  constexpr T operator[](int i) const { return (&this->x)[i]; }
};
#define MSL_VEC_OP(op)                                                                        \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, vec<T, N> b) {                 \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = a[i] op b[i]; return r; }                 \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, T b) { return a op vec<T, N>(b); } \
  template <class T, int N> vec<T, N> operator op(T a, vec<T, N> b) { return vec<T, N>(a) op b; } \
  template <class T, int N, class S> vec<T, N>& operator op##=(vec<T, N>& a, S b) { return a = a op b; }
MSL_VEC_OP(+)
MSL_VEC_OP(-)
MSL_VEC_OP(*)
MSL_VEC_OP(/)
#undef MSL_VEC_OP
#endif
}  // namespace metal
using metal::vec;
#define MSL_VEC_TYPES(t) typedef vec<t, 2> t##2; typedef vec<t, 3> t##3; typedef vec<t, 4> t##4;
MSL_VEC_TYPES(float)
MSL_VEC_TYPES(half)
MSL_VEC_TYPES(int)
MSL_VEC_TYPES(uint)
MSL_VEC_TYPES(short)
MSL_VEC_TYPES(ushort)
#undef MSL_VEC_TYPES

struct complex64_t {  // MLX's kernels/complex.h, as far as sort.h and unary_ops.h name it
  float real, imag;
  constexpr complex64_t(float r, float i) : real(r), imag(i) {}
};
complex64_t cexpf(complex64_t);  // kernels/cexpf.h: named by Exp, which no kernel here calls on complex values

namespace metal {
template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float min() { return 1.17549435e-38f; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bfloat max() { return bfloat(3.38953139e+38f); }
  static constexpr bfloat infinity() { return bfloat(__builtin_inff()); }
  static constexpr bfloat quiet_NaN() { return bfloat(__builtin_nanf("")); }
};
template <> struct numeric_limits<int> {
  static constexpr int max() { return 0x7fffffff; }
  static constexpr int min() { return -0x7fffffff - 1; }
};
template <> struct numeric_limits<uint> {
  static constexpr uint max() { return 0xffffffffu; }
  static constexpr uint min() { return 0u; }
};

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
void threadgroup_barrier(mem_flags);

template <class To, class From> To as_type(From v) { return __builtin_bit_cast(To, v); }
inline uint popcount(uint x) { return uint(__builtin_popcount(x)); }

// Math. MLX's bf16_math.h overloads each function for bfloat: the float
// function of the widened value, narrowed back.
float __msl_exp_fast(float);
float __msl_exp_precise(float);
float __msl_rsqrt_fast(float);
float __msl_rsqrt_precise(float);
namespace precise {
inline float exp(float x) { return __msl_exp_precise(x); }
inline float rsqrt(float x) { return __msl_rsqrt_precise(x); }
inline bfloat exp(bfloat x) { return bfloat(exp(float(x))); }
template <class V, class = decltype(V{}.x)> V exp(V v) { for (int i = 0; i < int(sizeof(V) / sizeof(v[0])); ++i) v[i] = exp(float(v[i])); return v; }
}  // namespace precise
namespace fast {
inline float exp(float x) { return __msl_exp_fast(x); }
inline float rsqrt(float x) { return __msl_rsqrt_fast(x); }
inline bfloat exp(bfloat x) { return bfloat(exp(float(x))); }
template <class V, class = decltype(V{}.x)> V exp(V v) { for (int i = 0; i < int(sizeof(V) / sizeof(v[0])); ++i) v[i] = exp(float(v[i])); return v; }
}  // namespace fast
// Unqualified: the fast forms (Apple: the default where fast math is off but
// the math mode is not precise, as MLX sets it on macOS 15 and later).
inline float exp(float x) { return fast::exp(x); }
inline float rsqrt(float x) { return fast::rsqrt(x); }
inline bfloat exp(bfloat x) { return bfloat(exp(float(x))); }
template <class V, class = decltype(V{}.x)> V exp(V v) { return fast::exp(v); }
inline float abs(float x) { return __builtin_fabsf(x); }
inline float fabs(float x) { return __builtin_fabsf(x); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline bfloat abs(bfloat x) { return bfloat(abs(float(x))); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
template <class V, class = decltype(V{}.x)> V fma(V a, V b, V c) {
  for (int i = 0; i < int(sizeof(V) / sizeof(a[0])); ++i) a[i] = fma(float(a[i]), float(b[i]), float(c[i])); return a; }
template <class T> T min(T a, T b) { return b < a ? b : a; }
template <class T> T max(T a, T b) { return a < b ? b : a; }
template <class T> T select(T a, T b, bool c) { return c ? b : a; }  // MSL's scalar select (quantized.h's 1-bit qdot)
inline bool isnan(float x) { return x != x; }
inline bool isnan(bfloat x) { return isnan(float(x)); }

// SIMD-group functions over the 32 lanes (the runtime below).
template <class T> T simd_sum(T v);
template <class T> T simd_shuffle(T v, ushort lane);
template <class T> T simd_shuffle_xor(T v, ushort mask);
struct simd_vote {
  ulong v;
  explicit operator ulong() const { return v; }
};
simd_vote simd_ballot(bool predicate);
}  // namespace metal
using namespace metal;  // as MLX's kernels/bf16.h has it

// MLX's kernels/utils.h, as far as the stock texts here use it.
template <typename U> struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
};
template <typename U, typename T> inline U cast_to(T val) { return static_cast<U>(val); }

#ifndef MSL_TYPECHECK
// ---- Emulation runtime: the threads of one threadgroup run as fibers (ucontext) on one host thread.
// A fiber runs until it waits at a barrier (threadgroup_barrier, or the one
// inside each SIMD-group function), then the next one runs; the threads run
// in index order, or in reverse with MSL_REVERSE_SCHEDULE (a read that needs
// a barrier it lacks then meets the unwritten value in one order or the other).

struct __msl_attributes {
  uint3 thread_position_in_grid, threadgroup_position_in_grid, thread_position_in_threadgroup;
  uint3 threads_per_threadgroup, threads_per_grid, threadgroups_per_grid;
  uint thread_index_in_simdgroup, simdgroup_index_in_threadgroup, thread_index_in_threadgroup;
  uint threads_per_simdgroup, simdgroups_per_threadgroup;
};
struct __msl_fiber {
  jmp_buf context;
  __msl_attributes attributes;
  bool done;
};
inline __msl_attributes __msl_host;  // msl_each's thread
inline __msl_attributes* __msl_self = &__msl_host;
#define __msl (*__msl_self)
// Switches: _setjmp/_longjmp (no signal-mask system call, unlike swapcontext,
// which only starts each fiber on its own stack).
inline jmp_buf __msl_scheduler;
inline __msl_fiber* __msl_running;
inline void __msl_yield() {
  if (!_setjmp(__msl_running->context)) _longjmp(__msl_scheduler, 1);
}
struct __msl_barrier {
  uint expected, arrived = 0;
  uint64_t generation = 0;
  explicit __msl_barrier(uint n) : expected(n) {}
  void arrive_and_wait() {
    const uint64_t g = generation;
    if (++arrived == expected) {
      arrived = 0;
      ++generation;
      return;
    }
    while (generation == g) __msl_yield();
  }
};
struct __msl_group {
  __msl_barrier all;
  std::deque<__msl_barrier> simds;
  std::vector<uint64_t> slots;
  explicit __msl_group(uint n) : all(n), slots(n) {
    for (uint s = 0; s < (n + 31) / 32; ++s) simds.emplace_back(n - 32 * s < 32 ? n - 32 * s : 32);
  }
};
inline __msl_group* __msl_current;
inline void metal::threadgroup_barrier(mem_flags) { __msl_current->all.arrive_and_wait(); }
inline uint __msl_lanes() {  // lanes in this thread's simdgroup (the last may be partial)
  uint n = __msl.threads_per_threadgroup.x * __msl.threads_per_threadgroup.y * __msl.threads_per_threadgroup.z;
  uint first = 32 * __msl.simdgroup_index_in_threadgroup;
  return n - first < 32 ? n - first : 32;
}
template <class T> inline void __msl_put(T v) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "a SIMD-group function of a scalar");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  __msl_current->slots[__msl.thread_index_in_threadgroup] = bits;
  __msl_current->simds[__msl.simdgroup_index_in_threadgroup].arrive_and_wait();
}
template <class T> inline T __msl_get(uint lane) {
  T v;
  std::memcpy(&v, &__msl_current->slots[32 * __msl.simdgroup_index_in_threadgroup + lane], sizeof(T));
  return v;
}
inline void __msl_done() { __msl_current->simds[__msl.simdgroup_index_in_threadgroup].arrive_and_wait(); }
// simd_sum: one fixed order for every caller, chosen at build time
// (MSL_SIMD_SUM_ORDER): 0 a butterfly (lane i adds lane i + 16, then + 8,
// ...), 1 in lane order from lane 0, 2 from lane 31 down. The hardware's
// order is unknown: a twin that matches stock under all three gives both
// sides the same lane values, whatever order the hardware adds them in.
#ifndef MSL_SIMD_SUM_ORDER
#define MSL_SIMD_SUM_ORDER 0
#endif
template <class T> T metal::simd_sum(T v) {
  uint lanes = __msl_lanes();
  __msl_put(v);
  T part[32];
  for (uint i = 0; i < 32; ++i) part[i] = i < lanes ? __msl_get<T>(i) : T(0);
  __msl_done();
  if (MSL_SIMD_SUM_ORDER == 1) {
    T s = part[0];
    for (uint i = 1; i < 32; ++i) s = s + part[i];
    return s;
  }
  if (MSL_SIMD_SUM_ORDER == 2) {
    T s = part[31];
    for (int i = 30; i >= 0; --i) s = s + part[i];
    return s;
  }
  for (uint off = 16; off > 0; off >>= 1)
    for (uint i = 0; i < off; ++i) part[i] = part[i] + part[i + off];
  return part[0];
}
template <class T> T metal::simd_shuffle(T v, ushort lane) {
  __msl_put(v);
  T r = __msl_get<T>(lane % 32u);
  __msl_done();
  return r;
}
template <class T> T metal::simd_shuffle_xor(T v, ushort mask) {
  return simd_shuffle(v, ushort(__msl.thread_index_in_simdgroup ^ mask));
}
inline metal::simd_vote metal::simd_ballot(bool p) {
  uint lanes = __msl_lanes();
  __msl_put(uint(p));
  ulong m = 0;
  for (uint i = 0; i < lanes; ++i) m |= ulong(__msl_get<uint>(i)) << i;
  __msl_done();
  return simd_vote{m};
}
// precise: the correctly rounded float function. fast: another float
// approximation (exp2 of a float product; rsqrt through a float sqrt and
// reciprocal), which differs from it in the last bits for most inputs.
inline float metal::__msl_exp_precise(float x) { return float(std::exp(double(x))); }
inline float metal::__msl_exp_fast(float x) { return std::exp2f(x * 1.44269504f); }
inline float metal::__msl_rsqrt_precise(float x) { return float(1.0 / std::sqrt(double(x))); }
inline float metal::__msl_rsqrt_fast(float x) { return 1.0f / std::sqrt(x); }

// Runs fn() as every thread of a 1D-3D grid (MLX dispatches threads: the
// last threadgroup along an axis may be partial), one threadgroup after another.
#ifndef MSL_REVERSE_SCHEDULE
#define MSL_REVERSE_SCHEDULE 0
#endif
inline void* __msl_body;
inline ucontext_t __msl_launcher, __msl_entry;
template <class F> void __msl_start() {
  (*static_cast<F*>(__msl_body))();
  __msl_running->done = true;
  _longjmp(__msl_scheduler, 1);
}
template <class F> void msl_run(uint3 grid, uint3 group, F fn) {
  const uint3 groups{(grid.x + group.x - 1) / group.x, (grid.y + group.y - 1) / group.y,
                     (grid.z + group.z - 1) / group.z};
  const uint most = group.x * group.y * group.z;
  constexpr size_t stack_size = 256 * 1024;
  std::vector<__msl_fiber> fibers(most);
  std::unique_ptr<char[]> stacks(new char[size_t(most) * stack_size]);  // untouched until a fiber uses it
  __msl_body = &fn;
  for (uint gz = 0; gz < groups.z; ++gz)
    for (uint gy = 0; gy < groups.y; ++gy)
      for (uint gx = 0; gx < groups.x; ++gx) {
        const uint3 size{group.x < grid.x - gx * group.x ? group.x : grid.x - gx * group.x,
                         group.y < grid.y - gy * group.y ? group.y : grid.y - gy * group.y,
                         group.z < grid.z - gz * group.z ? group.z : grid.z - gz * group.z};
        const uint n = size.x * size.y * size.z;
        __msl_group g(n);
        __msl_current = &g;
        for (uint t = 0; t < n; ++t) {
          const uint3 l{t % size.x, (t / size.x) % size.y, t / (size.x * size.y)};
          fibers[t].attributes = {{gx * group.x + l.x, gy * group.y + l.y, gz * group.z + l.z}, {gx, gy, gz}, l,
                                  size, grid, groups, t % 32, t / 32, t, 32, (n + 31) / 32};
          fibers[t].done = false;
        }
        // Each fiber's first turn starts it on its own stack; later turns resume it where it yielded.
        std::vector<bool> started(n, false);
        for (uint left = n; left > 0;) {
          left = 0;
          for (uint i = 0; i < n; ++i) {
            const uint t = MSL_REVERSE_SCHEDULE ? n - 1 - i : i;
            __msl_fiber& f = fibers[t];
            if (f.done) continue;
            __msl_running = &f;
            __msl_self = &f.attributes;
            if (!_setjmp(__msl_scheduler)) {
              if (started[t]) _longjmp(f.context, 1);
              started[t] = true;
              getcontext(&__msl_entry);
              __msl_entry.uc_stack.ss_sp = stacks.get() + size_t(t) * stack_size;
              __msl_entry.uc_stack.ss_size = stack_size;
              __msl_entry.uc_link = nullptr;
              makecontext(&__msl_entry, __msl_start<F>, 0);
              swapcontext(&__msl_launcher, &__msl_entry);
            }
            left += !f.done;
          }
        }
        __msl_self = &__msl_host;
        __msl_current = nullptr;
      }
}

// Runs fn() as every thread of a grid, one after another on this host
// thread: for kernels whose threads never meet (no barrier, no SIMD-group
// function), whose outputs do not depend on the threads' order.
template <class F> void msl_each(uint3 grid, F fn) {
  for (uint z = 0; z < grid.z; ++z)
    for (uint y = 0; y < grid.y; ++y)
      for (uint x = 0; x < grid.x; ++x) {
        __msl_host.thread_position_in_grid = {x, y, z};
        __msl_host.threads_per_grid = grid;
        fn();
      }
}
#endif
