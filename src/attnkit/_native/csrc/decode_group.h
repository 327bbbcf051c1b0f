// The decode path's products for many query rows that share a key/value head (grouped-query and
// multi-query attention, the absorbed form of latent attention: G rows a head, more than the
// kDotRows that dots and weigh take) with keys and values of another dtype than the products'
// (bfloat16, float16, int8, float8): each block of keys or values is converted to float32 once,
// into a buffer that stays in L1, and read from there by every row of the head in float32 FMAs.
//
// - s = alpha q k^T (group_dots): for each block of up to 4 keys, every block of up to 4 rows,
//   16 sums in registers along the head's dimension, reduced once per block (dot_block).
// - acc += p v (group_weigh): blocks of kGroupValues values, weigh's register tiles of 4 rows by
//   64 columns summed over the block.
//
// They replace converting a whole step of keys and values (one to two hundred KiB in float32 at
// latent attention's widths, past L1) for GEMMs. Where AVX512-BF16's dot products outrun the FMAs
// (bf16_dots_outrun_fma: AMD's cores issue one vdpbf16ps, 32 products, at the rate of one FMA,
// 16), bfloat16 queries, keys and values take the same blocks on them instead (group_dots_bf16,
// group_weigh_bf16), the keys read as they lie and the weights rounded to bfloat16; on CPUs that
// issue vdpbf16ps at half their FMAs' rate, the FMAs on converted rows do the same sums in less
// time, and keep the weights in float32.
#pragma once

#include "decode_tiles.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

#if defined(CPU_CAPABILITY_AVX512)
// f(r, R) for each block of 4 of m rows, from row r, the last of R = m % 4 rows if m is not a
// multiple of 4 (R a std::integral_constant: each block size runs a template of its own).
template <typename F>
ATTNKIT_INLINE void row_blocks(int64_t m, F&& f) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) f(r, std::integral_constant<int, 4>{});
  switch (m - r) {
    case 3:
      f(r, std::integral_constant<int, 3>{});
      break;
    case 2:
      f(r, std::integral_constant<int, 2>{});
      break;
    case 1:
      f(r, std::integral_constant<int, 1>{});
      break;
    default:
      break;
  }
}

// f(K) for a block of K = kb keys (1 to 4; K a std::integral_constant, as row_blocks gives R).
template <typename F>
ATTNKIT_INLINE void key_blocks(int64_t kb, F&& f) {
  switch (kb) {
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    default:
      f(std::integral_constant<int, 1>{});
      break;
  }
}

// s (m x n, ld) = alpha * a (m float32 rows of width d, lda) . x's rows: keys in blocks of 4,
// each block converted to float32 once (into wide, 4 d) and read from there by all m rows, 4 at
// a time. The next step's rows are asked for block by block.
template <typename X>
void group_dots(int64_t m, int64_t n, int64_t d, float alpha, const float* a, int64_t lda,
                RowList<X> x, float* s, int64_t ld, float* wide, const Ahead<X>& ahead) {
  for (int64_t j = 0; j < n; j += 4) {
    const int64_t kb = std::min<int64_t>(4, n - j);
    const float* rows[4];
    for (int64_t i = 0; i < kb; ++i) {
      convert_row(x[j + i], d, wide + i * d);
      rows[i] = wide + i * d;
    }
    // The next step's rows of this block asked for a few at a time, one share per block of rows:
    // asked for at once, their lines fill every buffer of misses and the prefetches stall.
    const int64_t blocks = (m + 3) / 4;
    row_blocks(m, [&](int64_t r, auto R) {
      ahead.for_keys(j + kb * (r / 4) / blocks, j + kb * (r / 4 + 1) / blocks, n);
      key_blocks(kb, [&](auto K) {
        dot_block<decltype(R)::value, decltype(K)::value>(d, alpha, a + r * lda, lda, rows,
                                                          s + r * ld + j, ld);
      });
    });
  }
}

// acc (m rows, dv wide) += p (m x n, ld) x's rows: values in blocks of kGroupValues, each
// converted to float32 once (into wide, kGroupValues dv) and weighed from there for all m rows
// (weigh's register tiles). The next step's rows are asked for block by block.
template <typename X>
void group_weigh(int64_t m, int64_t n, int64_t dv, const float* p, int64_t ld, RowList<X> x,
                 float* acc, float* wide, const Ahead<X>& ahead) {
  const float* rows[kGroupValues];
  for (int64_t j = 0; j < n; j += kGroupValues) {
    const int64_t nb = std::min(kGroupValues, n - j);
    ahead.for_keys(j, j + nb, n);
    for (int64_t i = 0; i < nb; ++i) {
      convert_row(x[j + i], dv, wide + i * dv);
      rows[i] = wide + i * dv;
    }
    weigh<float>(m, nb, dv, p + j, ld, RowList<float>{rows, 0}, acc, Ahead<float>{});
  }
}
#endif

#if defined(ATTNKIT_MATRIX_UNIT)
// The same products for bfloat16 queries (the queries' values exactly, b.q16) and keys and values
// on AVX512-BF16's dot products, where they outrun the FMAs (bf16_dots_outrun_fma): each
// instruction sums 32 products of pairs along the sum in float32. The keys are read as they lie
// (no conversion); the weights are rounded to bfloat16 for p v, as the forward's bfloat16
// products round them, and the softmax's sums keep them in float32.

// group_dots on the dot products: s (m x n, ld) = alpha * a (m bfloat16 rows, lda) . x's rows,
// for each block of 4 keys every block of 4 rows.
ATTNKIT_BF16 void group_dots_bf16(int64_t m, int64_t n, int64_t d, float alpha,
                                  const at::BFloat16* a, int64_t lda, RowList<at::BFloat16> x,
                                  float* s, int64_t ld, const Ahead<at::BFloat16>& ahead) {
  for (int64_t j = 0; j < n; j += 4) {
    const int64_t kb = std::min<int64_t>(4, n - j);
    const at::BFloat16* rows[4];
    for (int64_t i = 0; i < kb; ++i) rows[i] = x[j + i];
    const int64_t blocks = (m + 3) / 4;  // the next step's rows asked for as group_dots asks
    row_blocks(m, [&](int64_t r, auto R) {
      ahead.for_keys(j + kb * (r / 4) / blocks, j + kb * (r / 4 + 1) / blocks, n);
      key_blocks(kb, [&](auto K) {
        dot_block_bf16<decltype(R)::value, decltype(K)::value>(d, alpha, a + r * lda, lda, rows,
                                                               s + r * ld + j, ld);
      });
    });
  }
}

// The bfloat16 elements of a pair buffer's row (pair_width(dv) of them): two value rows
// interleaved, 16 columns at a time, padded to a multiple of 32 columns.
inline int64_t pair_width(int64_t dv) { return (dv + 31) / 32 * 64; }

// Rows a and b (b null: zeros) of dv bfloat16 as pairs (a[c], b[c]) in out's 32-bit words, word
// c for column c (the columns past dv 0).
ATTNKIT_BF16 inline void interleave_rows(const at::BFloat16* a, const at::BFloat16* b, int64_t dv,
                                         at::BFloat16* out) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                       8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t c = 0; c < dv; c += 32) {
    const __mmask32 m = dv - c >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (dv - c)) - 1);
    const __m512i x = _mm512_maskz_loadu_epi16(m, a + c);
    const __m512i y = b == nullptr ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi16(m, b + c);
    _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi16(x, low, y));
    _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi16(x, high, y));
  }
}

// acc rows 0 .. R - 1 (columns of NV vectors from c0, the last holding `tail` when tail > 0) +=
// the weights w (R rows of np pairs, ldw words apart) x the pairs of value rows (np pair rows of
// width pw, see interleave_rows): weigh_tile on the dot products, each pair row's vectors loaded
// once for the R rows.
template <int R, int NV>
ATTNKIT_BF16 ATTNKIT_INLINE void weigh_tile_bf16(int64_t np, const uint32_t* w, int64_t ldw,
                                                 const at::BFloat16* pairs, int64_t pw,
                                                 int64_t c0, int64_t tail, float* acc,
                                                 int64_t ldc) {
  __m512 o[R][NV];
  const __mmask16 last = tail > 0 ? __mmask16((1u << tail) - 1) : __mmask16(0xffff);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      o[r][v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : __mmask16(0xffff),
                                      acc + r * ldc + c0 + v * 16);
  for (int64_t t = 0; t < np; ++t) {
    const at::BFloat16* row = pairs + t * pw + 2 * c0;
    __m512bh xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = (__m512bh)_mm512_loadu_si512(row + 32 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh wr = (__m512bh)_mm512_set1_epi32(int(w[r * ldw + t]));
      for (int v = 0; v < NV; ++v) o[r][v] = _mm512_dpbf16_ps(o[r][v], wr, xv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      _mm512_mask_storeu_ps(acc + r * ldc + c0 + v * 16, v == NV - 1 ? last : __mmask16(0xffff),
                            o[r][v]);
}

// weigh_tile_bf16 over a row's width, rows of R. (Not always inlined: a lambda that calls it
// is compiled without AVX512-BF16.)
template <int R>
ATTNKIT_BF16 inline void weigh_rows_bf16(int64_t np, const uint32_t* w, int64_t ldw,
                                         const at::BFloat16* pairs, int64_t pw, int64_t dv,
                                         float* acc, int64_t ldc) {
  int64_t c0 = 0;
  for (; c0 + 64 <= dv; c0 += 64) weigh_tile_bf16<R, 4>(np, w, ldw, pairs, pw, c0, 0, acc, ldc);
  for (; c0 < dv; c0 += 16) {
    weigh_tile_bf16<R, 1>(np, w, ldw, pairs, pw, c0, dv - c0 >= 16 ? 0 : dv - c0, acc, ldc);
  }
}

// group_weigh on the dot products: acc (m rows, dv wide) += p (m x n, ld) x's rows. The weights
// are rounded to bfloat16 once (into w16, m rows of n + 1, even); the values in blocks of
// kGroupValues, each interleaved into pairs once (into pairs, kGroupValues / 2 pair rows) and
// weighed from there for all m rows, 4 at a time.
ATTNKIT_BF16 void group_weigh_bf16(int64_t m, int64_t n, int64_t dv, const float* p, int64_t ld,
                                   RowList<at::BFloat16> x, float* acc, at::BFloat16* w16,
                                   at::BFloat16* pairs, const Ahead<at::BFloat16>& ahead) {
  const int64_t lw = (n + 1) / 2 * 2;  // a row's weights, even: whole pairs
  for (int64_t r = 0; r < m; ++r) {
    row_to_bf16(p + r * ld, n, w16 + r * lw);
    if (lw > n) w16[r * lw + n] = at::BFloat16(0.0f);
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(w16);
  const int64_t pw = pair_width(dv);
  for (int64_t j = 0; j < n; j += kGroupValues) {
    const int64_t nb = std::min(kGroupValues, n - j), np = (nb + 1) / 2;
    ahead.for_keys(j, j + nb, n);
    for (int64_t t = 0; t < np; ++t) {
      interleave_rows(x[j + 2 * t], 2 * t + 1 < nb ? x[j + 2 * t + 1] : nullptr, dv,
                      pairs + t * pw);
    }
    const uint32_t* wj = w + j / 2;
    row_blocks(m, [&](int64_t r, auto R) {
      weigh_rows_bf16<decltype(R)::value>(np, wj + r * lw / 2, lw / 2, pairs, pw, dv,
                                          acc + r * dv, dv);
    });
  }
}
#endif

}  // namespace
}  // namespace attnkit
