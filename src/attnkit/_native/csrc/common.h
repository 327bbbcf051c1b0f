// What every part of attnkit's native kernel shares: the BLAS torch links, the rows of a tensor
// as the kernel reads them, the dropout generator and the parallel region's habits.
#pragma once

// GCC 12's AVX-512 intrinsics start some results from a placeholder initialised with itself
// (`__m512 __Y = __Y;`), which -Wuninitialized and -Wmaybe-uninitialized then report wherever
// the kernel or at::vec inlines them (GCC's bug 105593, fixed in GCC 13): false positives in the
// compiler's own header. The header is read here first, with those warnings off for its lines
// only (its include guard keeps the later includes from reading it again), so they stay on for
// the kernel's own code.
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

// The tensor, and CPU allocation without the operator dispatch: ATen/ATen.h declares every
// operator torch has, and parsing it was most of each source file's build time.
#include <ATen/Dispatch.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

#include "share.h"

extern "C" {
// The BLAS that torch links (weak: a build without it uses the loops below).
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*, const int*)
    __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*) __attribute__((weak));
// MKL's per-thread thread count (C interface); absent with another BLAS.
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace attnkit {
// Internal linkage, as in one translation unit: each .cpp gets its own copy of these helpers,
// which the compiler then inlines and specialises freely (their hot loops depend on it).
namespace {

using Vec = at::vec::Vectorized<float>;

// The kernel's outputs and buffers: CPU tensors, allocated directly (what at::empty and at::zeros
// do for a CPU tensor, without going through the dispatcher).
inline at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cpu(sizes, options));
}
inline at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = empty(sizes, options);
  t.zero_();
  return t;
}
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

// Dropout's generator: the pair with counter c is kept iff the top 24 bits of
// splitmix64(c, seed) are >= p * 2^24 (attnkit._kernel.dropout computes the same bits).
inline uint64_t splitmix64(uint64_t counter, uint64_t seed) {
  uint64_t z = seed + (counter + 1) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Rows of a (N, Hkv, G, T, D) tensor, or of a (N, X, T, D) one (its g stride 0), each row
// contiguous, at any strides between them: q, k and v come as views of the layout the caller has
// ((B, T, H, D) as well as (B, H, T, D)), and GEMMs read the rows with their stride as leading
// dimension.
template <typename P>
struct Rows {
  P p = nullptr;
  int64_t s[4] = {0, 0, 0, 0};  // strides of n, hk (or x), g, the row
  // The first row p holds: 0, or the first of a stretch of rows copied into a buffer (whose rows
  // before it are never asked for).
  int64_t i0 = 0;

  P at(int64_t n, int64_t hk, int64_t g, int64_t i) const {
    return p + n * s[0] + hk * s[1] + g * s[2] + (i - i0) * s[3];
  }
  int64_t ld() const { return s[3]; }
};

template <typename P>
Rows<P> rows_of(const at::Tensor& t, P p) {
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, "rows must be contiguous");
  Rows<P> r;
  r.p = p;
  if (t.dim() == 5) {
    for (int d = 0; d < 4; ++d) r.s[d] = t.stride(d);
  } else {
    TORCH_CHECK(t.dim() == 4, "a 4-d or 5-d tensor");
    r.s[0] = t.stride(0);
    r.s[1] = t.stride(1);
    r.s[3] = t.stride(2);
  }
  // A leading dimension must be at least the row's length (for a single row, any will do).
  if (r.s[3] < std::max<int64_t>(t.size(-1), 1)) {
    TORCH_CHECK(t.size(-2) <= 1, "rows must not overlap");
    r.s[3] = std::max<int64_t>(t.size(-1), 1);
  }
  return r;
}

// Keys and values may come in bfloat16 or float16 while the kernel computes in float32: a vector
// of T from Vectorized<T>::size() elements of x's type, converted in registers (bfloat16 is a
// shift, float16 F16C's conversion), or from `count` of them, the other lanes 0.
template <typename X>
constexpr bool is_reduced = std::is_same_v<X, at::BFloat16> || std::is_same_v<X, at::Half>;

// Quantized keys and values (the decode path's alone): int8, or float8 in either format, read as
// they are (a byte each) and converted in registers; their scales multiply the products they
// enter (see decode_pages.h), never the elements.
template <typename X>
constexpr bool is_quantized = std::is_same_v<X, int8_t> || std::is_same_v<X, c10::Float8_e4m3fn> ||
                              std::is_same_v<X, c10::Float8_e5m2>;

// What the decode path reads a quantized element as, over its value: float8 e4m3fn's elements come
// as their values times 2^-8 (see quantized16), and the factors of the products they enter carry
// the 2^8 back once (the scores' factor, each output row's 1 / l), where a multiply of every element
// took 7% of an e4m3 decode's time. Exact: a power of two, and the products and sums 2^8 smaller
// stay far from float32's smallest normal numbers.
template <typename X>
constexpr float kQuantizedUnit = std::is_same_v<X, c10::Float8_e4m3fn> ? 0x1p-8f : 1.0f;

#if defined(CPU_CAPABILITY_AVX512)
// 16 bytes of quantized elements as 16 float32 lanes, exactly: int8 through int32; float8 e5m2 is
// float16's upper byte; e4m3fn's bits moved into float16's places (exponent bias 15 rather than
// 7, so the float16 is the value times 2^-8 = kQuantizedUnit, subnormals included), its one NaN
// (S.1111.111) made NaN.
template <typename X>
inline __m512 quantized16(__m128i bytes) {
  if constexpr (std::is_same_v<X, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else if constexpr (std::is_same_v<X, c10::Float8_e5m2>) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
  } else {
    static_assert(std::is_same_v<X, c10::Float8_e4m3fn>, "int8, float8_e4m3fn or float8_e5m2");
    // Sign-extended and shifted by 7: the sign lands in bits 15 and 14, exponent and mantissa in
    // 13 to 7; clearing bit 14 leaves float16's layout.
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                       _mm256_set1_epi16(int16_t(0xbf80)));
    const __m512 x = _mm512_cvtph_ps(h);
    const __m256i nan_bits = _mm256_set1_epi16(0x3f80);
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, nan_bits), nan_bits);
    return _mm512_mask_mov_ps(x, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
}
#endif

// An element of x as T, as the decode path reads it (a quantized one as kQuantizedUnit times its
// value).
template <typename T, typename X>
inline T element_as(X x) {
  if constexpr (is_quantized<X>) {
    return T(float(x) * kQuantizedUnit<X>);
  } else {
    return T(x);
  }
}

template <typename T, typename X>
inline at::vec::Vectorized<T> load_as(const X* x) {
  if constexpr (std::is_same_v<T, X>) {
    return at::vec::Vectorized<T>::loadu(x);
  } else if constexpr (is_quantized<X>) {
    static_assert(std::is_same_v<T, float>, "float32 from int8/float8");
#if defined(CPU_CAPABILITY_AVX512)
    return quantized16<X>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
#else
    alignas(64) float part[Vec::size()];
    for (int64_t i = 0; i < Vec::size(); ++i) part[i] = element_as<float>(x[i]);
    return Vec::loadu(part);
#endif
  } else {
    static_assert(std::is_same_v<T, float> && is_reduced<X>, "float32 from bfloat16/float16");
    Vec out;
    at::vec::load_to_float<X>(x, out);
    return out;
  }
}

template <typename T, typename X>
inline at::vec::Vectorized<T> load_as(const X* x, int64_t count) {
  if constexpr (std::is_same_v<T, X>) {
    return at::vec::Vectorized<T>::loadu(x, count);
  } else {
    alignas(64) T part[at::vec::Vectorized<T>::size()] = {};
    for (int64_t i = 0; i < count; ++i) part[i] = element_as<T>(x[i]);
    return at::vec::Vectorized<T>::loadu(part);
  }
}

// n elements of x as T, at out.
template <typename T, typename X>
inline void convert_row(const X* x, int64_t n, T* out) {
  using V = at::vec::Vectorized<T>;
  int64_t e = 0;
  for (; e + V::size() <= n; e += V::size()) load_as<T>(x + e).store(out + e);
  for (; e < n; ++e) out[e] = element_as<T>(x[e]);
}

// Inside the parallel region each item's GEMMs run on the calling thread: a BLAS that opened its
// own threads there would make every thread wait on the others' GEMMs.
struct OneBlasThread {
  int previous = 0;
  OneBlasThread() {
    if (MKL_Set_Num_Threads_Local != nullptr) previous = MKL_Set_Num_Threads_Local(1);
  }
  ~OneBlasThread() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous);
  }
};

// Each thread of a parallel region claims the next unclaimed item until none is left, instead
// of running a fixed share: on a core shared with another process a thread runs slower, and
// the others then take more of the items rather than wait for it at the region's end.
inline int64_t claim(std::atomic<int64_t>& next) {
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace
}  // namespace attnkit
