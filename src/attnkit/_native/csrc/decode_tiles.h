// The decode path's products of few rows, in registers: s = alpha q k^T as dot products (dots:
// blocks of 16 sums in AVX-512 registers, AVX512-BF16's dot products for bfloat16 queries and
// keys, at::vec elsewhere) and acc += p v (weigh: register tiles summed over a step's keys), each
// reading keys and values wherever their rows lie, converted from bfloat16 or float16 as they
// are loaded. tiles.h's register tiles read a right operand at one stride; these take a list of
// rows (pages), and few enough query rows that the BLAS's packing would cost more than the sums.
#pragma once

#include "decode_pages.h"
#include "matrix_unit.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

// The products, weighted values and softmax of a step, inlined where they are called: with two
// callers (run_step, run_token_step) GCC leaves them out of line, and a head-major bfloat16
// decode then took 9% longer.
#define ATTNKIT_INLINE inline __attribute__((always_inline))

// The sum of a vector's lanes.
template <typename T>
T lanes_sum(const at::vec::Vectorized<T>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_reduce_add_ps(x);
  } else {
    return _mm512_reduce_add_pd(x);
  }
#else
  using V = at::vec::Vectorized<T>;
  return at::vec::vec_reduce_all<T>([](V& a, V& b) { return a + b; }, x);
#endif
}

// s rows 0 .. R - 1 (columns j of n, ld) = alpha * a's rows . x's row j: each row of x is loaded
// once for the R rows.
template <typename T, int R, typename X>
void dot_rows(int64_t n, int64_t d, T alpha, const T* a, int64_t lda, RowList<X> x, T* s,
              int64_t ld, const Ahead<X>& ahead) {
  using V = at::vec::Vectorized<T>;
  constexpr int64_t W = V::size();
  const int64_t full = d - d % W, tail = d % W;
  for (int64_t j = 0; j < n; ++j) {
    ahead.for_keys(j, j + 1, n);
    const X* xr = x[j];
    V acc[R];
    for (int i = 0; i < R; ++i) acc[i] = V(T(0));
    for (int64_t e = 0; e < full; e += W) {
      const V xv = load_as<T>(xr + e);
      for (int i = 0; i < R; ++i) acc[i] = at::vec::fmadd(V::loadu(a + i * lda + e), xv, acc[i]);
    }
    if (tail > 0) {
      const V xv = load_as<T>(xr + full, tail);
      for (int i = 0; i < R; ++i) {
        acc[i] = at::vec::fmadd(V::loadu(a + i * lda + full, tail), xv, acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) s[i * ld + j] = alpha * lanes_sum(acc[i]);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The elements of x that m selects as 16 float32 lanes (the others 0): bfloat16 widened to 32 bits
// and shifted into the float's upper half, float16 converted, int8 and float8 as quantized16 reads
// them.
template <typename X>
inline __m512 load16(__mmask16 m, const X* x) {
  if constexpr (std::is_same_v<X, float>) {
    return _mm512_maskz_loadu_ps(m, x);
  } else if constexpr (is_quantized<X>) {
    return quantized16<X>(_mm_maskz_loadu_epi8(m, x));
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, x);
    if constexpr (std::is_same_v<X, at::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      static_assert(std::is_same_v<X, at::Half>, "float32, bfloat16 or float16");
      return _mm512_cvtph_ps(h);
    }
  }
}

// The lane sums of 16 vectors as one vector: lane i holds the sum of v[i]'s lanes. Pairs are
// added lane by lane within 128-bit blocks, then pairs of pairs, then the four blocks: 15 adds
// and 30 shuffles for 16 sums, where one horizontal sum each would take 16 chains of 8.
inline __m512 lane_sums16(const __m512 (&v)[16]) {
  __m512 t[8];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 u[4];  // u[i]'s 128-bit block b: block b's sums of v[4i], ..., v[4i + 3]
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s rows 0 .. R - 1, columns 0 .. K - 1 (ld) = alpha * the lane sums of acc, lane K r + j for
// row r, key j.
template <int R, int K>
ATTNKIT_INLINE void store_block(const __m512 (&acc)[16], float alpha, float* s, int64_t ld) {
  // (lane_sums16 takes a copy: an array whose address is taken lives in memory, and GCC then
  // stores the sums there at every step.)
  __m512 sums[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) sums[i] = acc[i];
  alignas(64) float out[16];
  _mm512_store_ps(out, _mm512_mul_ps(lane_sums16(sums), _mm512_set1_ps(alpha)));
  for (int r = 0; r < R; ++r) std::copy(out + r * K, out + (r + 1) * K, s + r * ld);
}

// s rows 0 .. R - 1, columns 0 .. K - 1 (R K = 16) = alpha * a's rows . x's rows 0 .. K - 1: 16
// dot products in 16 registers, each vector of a and of x loaded once for them.
// (R K < 16: a block of fewer, the other sums 0.)
template <int R, int K, typename X>
inline void dot_block(int64_t d, float alpha, const float* a, int64_t lda, const X* const* x,
                      float* s, int64_t ld) {
  static_assert(R * K <= 16, "a block of at most 16 dot products");
  // (unrolled: as a loop GCC makes the zeroing a memset, which keeps the sums in memory,
  // stored at every step)
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; e += 16) {
    const __mmask16 m = d - e >= 16 ? __mmask16(0xffff) : __mmask16((1u << (d - e)) - 1);
    __m512 xv[K];
    for (int j = 0; j < K; ++j) xv[j] = load16(m, x[j] + e);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_maskz_loadu_ps(m, a + r * lda + e);
      for (int j = 0; j < K; ++j) acc[r * K + j] = _mm512_fmadd_ps(av, xv[j], acc[r * K + j]);
    }
  }
  store_block<R, K>(acc, alpha, s, ld);
}

// dot_rows for R rows of float32 (R = 1, 2 or 4): blocks of 16 / R keys.
template <int R, typename X>
void dot_blocks(int64_t n, int64_t d, float alpha, const float* a, int64_t lda, RowList<X> x,
                float* s, int64_t ld, const Ahead<X>& ahead) {
  constexpr int K = 16 / R;
  int64_t j = 0;
  for (; j + K <= n; j += K) {
    ahead.for_keys(j, j + K, n);
    const X* rows[K];
    for (int i = 0; i < K; ++i) rows[i] = x[j + i];
    dot_block<R, K>(d, alpha, a, lda, rows, s + j, ld);
  }
  if (j < n) {
    ahead.for_keys(j, n, n);
    RowList<X> rest{x.p + j, x.off};
    dot_rows<float, R>(n - j, d, alpha, a, lda, rest, s + j, ld, Ahead<X>{});
  }
}
#endif

#if defined(ATTNKIT_MATRIX_UNIT)
// dot_block for bfloat16 queries and keys, on AVX512-BF16's dot products (each lane += the sum of
// two products, 32 elements a register): half the instructions of float32 FMAs on converted
// keys. Its products are exact in float32 like theirs, but the sums' order differs, and inputs or
// sums below float32's normal range (under 1.2e-38) count as 0.
template <int R, int K>
ATTNKIT_BF16 inline void dot_block_bf16(int64_t d, float alpha, const at::BFloat16* a,
                                        int64_t lda, const at::BFloat16* const* x, float* s,
                                        int64_t ld) {
  static_assert(R * K <= 16, "a block of at most 16 dot products");
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; e += 32) {
    const __mmask32 m = d - e >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (d - e)) - 1);
    __m512bh xv[K];
    for (int j = 0; j < K; ++j) xv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, x[j] + e);
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, a + r * lda + e);
      for (int j = 0; j < K; ++j) acc[r * K + j] = _mm512_dpbf16_ps(acc[r * K + j], av, xv[j]);
    }
  }
  store_block<R, K>(acc, alpha, s, ld);
}

// dot_blocks on dot_block_bf16 (the keys left after the blocks of 16 / R, as float32).
template <int R>
ATTNKIT_BF16 void dot_blocks_bf16(int64_t n, int64_t d, float alpha, const at::BFloat16* a,
                                  const float* a32, int64_t lda, RowList<at::BFloat16> x,
                                  float* s, int64_t ld, const Ahead<at::BFloat16>& ahead) {
  constexpr int K = 16 / R;
  int64_t j = 0;
  for (; j + K <= n; j += K) {
    ahead.for_keys(j, j + K, n);
    const at::BFloat16* rows[K];
    for (int i = 0; i < K; ++i) rows[i] = x[j + i];
    dot_block_bf16<R, K>(d, alpha, a, lda, rows, s + j, ld);
  }
  if (j < n) {
    ahead.for_keys(j, n, n);
    RowList<at::BFloat16> rest{x.p + j, x.off};
    dot_rows<float, R>(n - j, d, alpha, a32, lda, rest, s + j, ld, Ahead<at::BFloat16>{});
  }
}

// dots (float32 rows of a, of which a16 holds the same values in bfloat16) on dot_blocks_bf16.
ATTNKIT_BF16 void dots_bf16(int64_t m, int64_t n, int64_t d, float alpha, const at::BFloat16* a16,
                            const float* a, int64_t lda, RowList<at::BFloat16> x, float* s,
                            int64_t ld, Ahead<at::BFloat16> ahead) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4, ahead = Ahead<at::BFloat16>{}) {
    dot_blocks_bf16<4>(n, d, alpha, a16 + r * lda, a + r * lda, lda, x, s + r * ld, ld, ahead);
  }
  if (m - r >= 2) {
    dot_blocks_bf16<2>(n, d, alpha, a16 + r * lda, a + r * lda, lda, x, s + r * ld, ld, ahead);
    ahead = Ahead<at::BFloat16>{};
    r += 2;
  }
  if (m - r == 1) {
    dot_blocks_bf16<1>(n, d, alpha, a16 + r * lda, a + r * lda, lda, x, s + r * ld, ld, ahead);
  }
}
#endif

// s (m x n, ld) = alpha * a (m rows of width d, lda) x^T (n rows), for few rows: the BLAS's
// dispatch and packing would cost more than these products. The next step's rows are asked for
// once, by the first rows' products.
template <typename T, typename X>
ATTNKIT_INLINE void dots(int64_t m, int64_t n, int64_t d, T alpha, const T* a, int64_t lda, RowList<X> x, T* s,
          int64_t ld, Ahead<X> ahead) {
  int64_t r = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    for (; r + 4 <= m; r += 4, ahead = Ahead<X>{}) {
      dot_blocks<4>(n, d, alpha, a + r * lda, lda, x, s + r * ld, ld, ahead);
    }
    if (m - r >= 2) {
      dot_blocks<2>(n, d, alpha, a + r * lda, lda, x, s + r * ld, ld, ahead);
      ahead = Ahead<X>{};
      r += 2;
    }
    if (m - r == 1) dot_blocks<1>(n, d, alpha, a + r * lda, lda, x, s + r * ld, ld, ahead);
    return;
  }
#endif
  for (; r + 4 <= m; r += 4, ahead = Ahead<X>{}) {
    dot_rows<T, 4>(n, d, alpha, a + r * lda, lda, x, s + r * ld, ld, ahead);
  }
  switch (m - r) {
    case 3:
      dot_rows<T, 3>(n, d, alpha, a + r * lda, lda, x, s + r * ld, ld, ahead);
      break;
    case 2:
      dot_rows<T, 2>(n, d, alpha, a + r * lda, lda, x, s + r * ld, ld, ahead);
      break;
    case 1:
      dot_rows<T, 1>(n, d, alpha, a + r * lda, lda, x, s + r * ld, ld, ahead);
      break;
    default:
      break;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// acc rows 0 .. R - 1 (columns of NV vectors from c0, the last holding `tail` when tail > 0) += p
// (R x n, ld) x's rows: each value row's vectors loaded once for the R rows, the sums in
// registers over all n keys (as tiles.h's register tiles, with the rows wherever they lie).
template <int R, int NV, typename X>
ATTNKIT_INLINE void weigh_tile(int64_t n, const float* p, int64_t ld, RowList<X> x, int64_t c0,
                               int64_t tail, float* acc, int64_t ldc, const Ahead<X>& ahead) {
  constexpr int W = 16;
  __m512 o[R][NV];
  const __mmask16 last = tail > 0 ? __mmask16((1u << tail) - 1) : __mmask16(0xffff);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      o[r][v] =
          _mm512_maskz_loadu_ps(v == NV - 1 ? last : __mmask16(0xffff), acc + r * ldc + c0 + v * W);
  for (int64_t j = 0; j < n; ++j) {
    ahead.for_keys(j, j + 1, n);
    const X* xr = x[j] + c0;
    __m512 xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = load16(v == NV - 1 ? last : __mmask16(0xffff), xr + v * W);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * ld + j]);
      for (int v = 0; v < NV; ++v) o[r][v] = _mm512_fmadd_ps(w, xv[v], o[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      _mm512_mask_storeu_ps(acc + r * ldc + c0 + v * W, v == NV - 1 ? last : __mmask16(0xffff),
                            o[r][v]);
}

// weigh_tile over a row's width; the first tile also asks for ahead's rows.
template <int R, typename X>
ATTNKIT_INLINE void weigh_rows_of(int64_t n, int64_t dv, const float* p, int64_t ld, RowList<X> x,
                                  float* acc, int64_t ldc, Ahead<X> ahead) {
  int64_t c0 = 0;
  for (; c0 + 64 <= dv; c0 += 64, ahead = Ahead<X>{}) {
    weigh_tile<R, 4>(n, p, ld, x, c0, 0, acc, ldc, ahead);
  }
  for (; c0 < dv; c0 += 16, ahead = Ahead<X>{}) {
    weigh_tile<R, 1>(n, p, ld, x, c0, dv - c0 >= 16 ? 0 : dv - c0, acc, ldc, ahead);
  }
}
#endif

// Whether weigh asks for an Ahead's rows while it runs (else it ignores them).
template <typename T>
constexpr bool kWeighAsks =
#if defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<T, float>;
#else
    false;
#endif

// acc rows 0 .. R - 1 (columns c0 .. c0 + NV W - 1, ldc) += p (R x n, ld) x's rows, in vectors of
// at::vec: weigh_tile's register tile where the build has no AVX-512, each value row's vectors
// loaded (and converted) once for the R rows.
template <typename T, int R, int NV, typename X>
inline void weigh_vectors(int64_t n, const T* p, int64_t ld, RowList<X> x, int64_t c0, T* acc,
                          int64_t ldc) {
  using V = at::vec::Vectorized<T>;
  constexpr int64_t W = V::size();
  V o[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) o[r][v] = V::loadu(acc + r * ldc + c0 + v * W);
  for (int64_t j = 0; j < n; ++j) {
    const X* xr = x[j] + c0;
    V xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = load_as<T>(xr + v * W);
    for (int r = 0; r < R; ++r) {
      const V w(p[r * ld + j]);
      for (int v = 0; v < NV; ++v) o[r][v] = at::vec::fmadd(w, xv[v], o[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) o[r][v].store(acc + r * ldc + c0 + v * W);
}

// weigh_vectors over a row's width: two vectors at a time, then one, then the columns left one by
// one.
template <typename T, int R, typename X>
void weigh_rows(int64_t n, int64_t dv, const T* p, int64_t ld, RowList<X> x, T* acc, int64_t ldc) {
  constexpr int64_t W = at::vec::Vectorized<T>::size();
  int64_t c0 = 0;
  for (; c0 + 2 * W <= dv; c0 += 2 * W) weigh_vectors<T, R, 2>(n, p, ld, x, c0, acc, ldc);
  for (; c0 + W <= dv; c0 += W) weigh_vectors<T, R, 1>(n, p, ld, x, c0, acc, ldc);
  for (; c0 < dv; ++c0) {
    for (int64_t j = 0; j < n; ++j) {
      const T xe = element_as<T>(x[j][c0]);
      for (int r = 0; r < R; ++r) acc[r * ldc + c0] += p[r * ld + j] * xe;
    }
  }
}

// acc (m rows, dv wide) += p (m x n, ld) x (n rows wherever they lie), for few rows; where
// kWeighAsks<T>, ahead's rows are asked for during the first rows' products.
template <typename T, typename X>
ATTNKIT_INLINE void weigh(int64_t m, int64_t n, int64_t dv, const T* p, int64_t ld, RowList<X> x,
                          T* acc, [[maybe_unused]] Ahead<X> ahead) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4, ahead = Ahead<X>{}) {
      weigh_rows_of<4>(n, dv, p + r * ld, ld, x, acc + r * dv, dv, ahead);
    }
    switch (m - r) {
      case 3:
        weigh_rows_of<3>(n, dv, p + r * ld, ld, x, acc + r * dv, dv, ahead);
        break;
      case 2:
        weigh_rows_of<2>(n, dv, p + r * ld, ld, x, acc + r * dv, dv, ahead);
        break;
      case 1:
        weigh_rows_of<1>(n, dv, p + r * ld, ld, x, acc + r * dv, dv, ahead);
        break;
      default:
        break;
    }
    return;
  }
#endif
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) weigh_rows<T, 4>(n, dv, p + r * ld, ld, x, acc + r * dv, dv);
  switch (m - r) {
    case 3:
      weigh_rows<T, 3>(n, dv, p + r * ld, ld, x, acc + r * dv, dv);
      break;
    case 2:
      weigh_rows<T, 2>(n, dv, p + r * ld, ld, x, acc + r * dv, dv);
      break;
    case 1:
      weigh_rows<T, 1>(n, dv, p + r * ld, ld, x, acc + r * dv, dv);
      break;
    default:
      break;
  }
}

}  // namespace
}  // namespace attnkit
