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
// 16), bfloat16 queries, keys and values take products of their own on them instead, the keys
// read as they lie and the weights rounded to bfloat16 (group_dots_bf16: 16 rows in a register's
// lanes; group_weigh_bf16: tiles of 16 rows by 16 columns over a whole step); on CPUs that issue
// vdpbf16ps at half their FMAs' rate, the FMAs on converted rows do the same sums in less time,
// and keep the weights in float32.
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
//
// q k^T puts 16 query rows in the 16 lanes of a register: for each pair of a key's elements
// (one 32-bit word, broadcast from where the key lies) one instruction adds its products with
// the same pair of all 16 rows, packed once per item (pack_lanes). Each lane ends with a whole
// dot product: nothing to reduce across lanes, and a key's row is read once for 16 rows. (Dot
// products along the rows instead, a register of 32 elements per row and key, end each block of
// rows and keys with a reduction across the lanes of every sum, and ran at 0.6 of the rate of a
// bfloat16 matrix product where this runs at its rate.)

// Words (pairs of elements) of a packed row of width d, and elements of a block of 16 packed rows.
inline int64_t lane_pairs(int64_t d) { return (d + 1) / 2; }
inline int64_t lane_block(int64_t d) { return 16 * 2 * lane_pairs(d); }

// a's m rows of width d (lda apart) in blocks of 16 rows (the last padded with zeros): word p of
// lane l of a block holds row l's elements 2p and 2p + 1 (0 past d), copied a word at a time.
inline void pack_lanes(const at::BFloat16* a, int64_t lda, int64_t m, int64_t d,
                       at::BFloat16* out) {
  const int64_t np = lane_pairs(d), whole = d / 2;
  for (int64_t b = 0; b < (m + 15) / 16; ++b) {
    at::BFloat16* block = out + b * lane_block(d);
    const int64_t rows = std::min<int64_t>(16, m - 16 * b);
    if (rows < 16 || whole < np) std::fill(block, block + lane_block(d), at::BFloat16(0.0f));
    for (int64_t l = 0; l < rows; ++l) {
      const at::BFloat16* row = a + (16 * b + l) * lda;
      for (int64_t p = 0; p < whole; ++p) std::memcpy(block + 2 * (16 * p + l), row + 2 * p, 4);
      if (whole < np) block[2 * (16 * whole + l)] = row[d - 1];
    }
  }
}

// acc[i] (16 lanes: the block's rows) += the packed rows q (np words, the last odd: a single
// element) . key rows x[i], i < K. Among the products, `asks` of the next step's lines are asked
// for (lines), one every other word: spread over the products, their misses overlap them
// instead of queueing at once.
template <int K>
ATTNKIT_BF16 ATTNKIT_INLINE void lane_dots(int64_t np, bool odd, const uint32_t* q,
                                           const at::BFloat16* const* x, __m512* acc,
                                           AskedLines<at::BFloat16>& lines, int64_t asks) {
  __m512 o[K];
  for (int i = 0; i < K; ++i) o[i] = _mm512_setzero_ps();
  const uint32_t* w[K];
  for (int i = 0; i < K; ++i) w[i] = reinterpret_cast<const uint32_t*>(x[i]);
  const int64_t whole = odd ? np - 1 : np;
  for (int64_t p = 0; p < whole; ++p) {
    if (p % 2 == 0 && p / 2 < asks) lines.next();
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + 16 * p);
    for (int i = 0; i < K; ++i) {
      uint32_t word;
      std::memcpy(&word, w[i] + p, 4);
      o[i] = _mm512_dpbf16_ps(o[i], qv, (__m512bh)_mm512_set1_epi32(int(word)));
    }
  }
  for (int64_t i = (whole + 1) / 2; i < asks; ++i) lines.next();
  if (odd) {  // the last element alone: the key's row ends there
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + 16 * whole);
    for (int i = 0; i < K; ++i) {
      uint16_t half;
      std::memcpy(&half, x[i] + 2 * whole, 2);
      o[i] = _mm512_dpbf16_ps(o[i], qv, (__m512bh)_mm512_set1_epi32(int(half)));
    }
  }
  for (int i = 0; i < K; ++i) acc[i] = o[i];
}

// t[i] (i < 16) becomes the 16 x 16 transpose's row i: t[i][j] = t_before[j][i].
ATTNKIT_INLINE void transpose16(__m512* t) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]);
  }
  // b[4 g + c], 128-bit lane L: element 4 L + c of rows 4 g .. 4 g + 3
  for (int g = 0; g < 4; ++g) {
    const __m512d x0 = _mm512_castps_pd(a[4 * g]), x1 = _mm512_castps_pd(a[4 * g + 1]);
    const __m512d x2 = _mm512_castps_pd(a[4 * g + 2]), x3 = _mm512_castps_pd(a[4 * g + 3]);
    b[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, x2));
    b[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x2));
    b[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, x3));
    b[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, x3));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 u0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x88);  // lanes 0, 2 of each
    const __m512 v0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xdd);  // lanes 1, 3 of each
    const __m512 u1 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xdd);
    t[c] = _mm512_shuffle_f32x4(u0, u1, 0x88);
    t[8 + c] = _mm512_shuffle_f32x4(u0, u1, 0xdd);
    t[4 + c] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(v0, v1, 0xdd);
  }
}

// lane_dots for keys [i, i + K) of a block of kk, with their share of the block's nask lines.
template <int K>
ATTNKIT_BF16 ATTNKIT_INLINE void key_share(int64_t np, bool odd, const uint32_t* q,
                                           const at::BFloat16* const* rows, __m512* t,
                                           AskedLines<at::BFloat16>& lines, int64_t nask,
                                           int64_t kk, int64_t i) {
  const int64_t a0 = nask * i / kk, a1 = nask * (i + K) / kk;
  lane_dots<K>(np, odd, q, rows + i, t + i, lines, a1 - a0);
}

// s (m x n, ld) = alpha * the packed rows qp (pack_lanes: m rows of width d) . x's rows: for each
// block of 16 rows, keys 16 at a time in lane_dots' blocks, transposed into s's rows. The next
// step's rows are asked for among the first block of rows' products, a share for each block of
// keys.
ATTNKIT_BF16 void group_dots_bf16(int64_t m, int64_t n, int64_t d, float alpha,
                                  const at::BFloat16* qp, RowList<at::BFloat16> x, float* s,
                                  int64_t ld, const Ahead<at::BFloat16>& ahead) {
  const int64_t np = lane_pairs(d);
  const bool odd = d % 2 != 0;
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t r0 = 0; r0 < m; r0 += 16) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(qp + (r0 / 16) * lane_block(d));
    const int64_t rows = std::min<int64_t>(16, m - r0);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t kk = std::min<int64_t>(16, n - j0);
      AskedLines<at::BFloat16> lines;
      if (r0 == 0) lines = ahead.lines_for_keys(j0, j0 + kk, n);
      const int64_t nask = lines.count();
      const at::BFloat16* rows_of[16];
      for (int64_t i = 0; i < kk; ++i) rows_of[i] = x[j0 + i];
      __m512 t[16];
      int64_t i = 0;
      for (; i + 8 <= kk; i += 8) key_share<8>(np, odd, q, rows_of, t, lines, nask, kk, i);
      for (; i + 4 <= kk; i += 4) key_share<4>(np, odd, q, rows_of, t, lines, nask, kk, i);
      for (; i + 2 <= kk; i += 2) key_share<2>(np, odd, q, rows_of, t, lines, nask, kk, i);
      for (; i < kk; ++i) key_share<1>(np, odd, q, rows_of, t, lines, nask, kk, i);
      for (; i < 16; ++i) t[i] = _mm512_setzero_ps();
      transpose16(t);
      const __mmask16 keys = __mmask16((1u << kk) - 1);
      for (int64_t r = 0; r < rows; ++r)
        _mm512_mask_storeu_ps(s + (r0 + r) * ld + j0, keys, _mm512_mul_ps(t[r], scale));
    }
  }
}

// p v sums over the keys, so its pairs are of neighbouring value rows: for each pair of value
// rows and 32 columns, two unpacks interleave them into two registers (pairs of columns 0-3,
// 8-11, 16-19, 24-27 and 4-7, 12-15, 20-23, 28-31), and every row of a block of 8 weighs both
// with its pair of weights, broadcast. The register tile (8 rows by 32 columns) holds the sums
// over all the step's values, and puts its columns in order once, when it adds them to acc.
// (One permutation into a register of 16 columns, weighed by 16 rows, ran at 0.75 of this one's
// rate: twice the broadcasts; pairs interleaved into a buffer once and read from there by all
// the rows, lower still: the buffer's stores and loads outnumbered the permutations.)

// lo[r], hi[r] += row r's pair of weights t (w: R rows, ldw words apart) x the pairs of value
// rows a and b's 32 columns, unpacked.
template <int R>
ATTNKIT_BF16 ATTNKIT_INLINE void weigh_pair(__m512* lo, __m512* hi, const uint32_t* w, int64_t ldw,
                                            int64_t t, __m512i a, __m512i b) {
  const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b);
  const __m512bh h = (__m512bh)_mm512_unpackhi_epi16(a, b);
  for (int r = 0; r < R; ++r) {
    const __m512bh wr = (__m512bh)_mm512_set1_epi32(int(w[r * ldw + t]));
    lo[r] = _mm512_dpbf16_ps(lo[r], wr, l);
    hi[r] = _mm512_dpbf16_ps(hi[r], wr, h);
  }
}

// acc rows 0 .. R - 1, columns c .. c + 31 (the first `width` of them) += the weights w (R rows
// of (n + 1) / 2 pairs, ldw words apart) x the value rows x (n of them; an odd last one paired
// with zeros).
template <int R>
ATTNKIT_BF16 ATTNKIT_INLINE void weigh_pairs(int64_t n, const uint32_t* w, int64_t ldw,
                                             RowList<at::BFloat16> x, int64_t c, int64_t width,
                                             float* acc, int64_t ldc) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const __mmask32 cols = width >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << width) - 1);
  const int64_t whole = n / 2;
  if (width >= 32) {
    for (int64_t t = 0; t < whole; ++t) {
      weigh_pair<R>(lo, hi, w, ldw, t, _mm512_loadu_si512(x[2 * t] + c),
                    _mm512_loadu_si512(x[2 * t + 1] + c));
    }
  } else {
    for (int64_t t = 0; t < whole; ++t) {
      weigh_pair<R>(lo, hi, w, ldw, t, _mm512_maskz_loadu_epi16(cols, x[2 * t] + c),
                    _mm512_maskz_loadu_epi16(cols, x[2 * t + 1] + c));
    }
  }
  if (n % 2 != 0) {
    weigh_pair<R>(lo, hi, w, ldw, whole, _mm512_maskz_loadu_epi16(cols, x[n - 1] + c),
                  _mm512_setzero_si512());
  }
  // lo's 128-bit lane L holds columns 8 L .. 8 L + 3, hi's 8 L + 4 .. 8 L + 7
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const int64_t w0 = std::min<int64_t>(16, width), w1 = std::max<int64_t>(0, width - 16);
  const __mmask16 m0 = __mmask16((1u << w0) - 1), m1 = __mmask16((1u << w1) - 1);
  for (int r = 0; r < R; ++r) {
    float* o = acc + r * ldc + c;
    const __m512 c0 = _mm512_permutex2var_ps(lo[r], first, hi[r]);
    const __m512 c1 = _mm512_permutex2var_ps(lo[r], second, hi[r]);
    _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), c0));
    if (w1 > 0) {
      _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), c1));
    }
  }
}

// weigh_pairs for columns c .. c + 31 of a row dv wide, rows of R. (Not always inlined: a lambda
// that calls it is compiled without AVX512-BF16.)
template <int R>
ATTNKIT_BF16 inline void weigh_rows_bf16(int64_t n, const uint32_t* w, int64_t ldw,
                                         RowList<at::BFloat16> x, int64_t c, int64_t dv,
                                         float* acc, int64_t ldc) {
  weigh_pairs<R>(n, w, ldw, x, c, std::min<int64_t>(32, dv - c), acc, ldc);
}

// group_weigh on the dot products: acc (m rows, dv wide) += p (m x n, ld) x's rows. The weights
// are rounded to bfloat16 once (into w16, m rows of n + 1, even); then for each 32 columns, every
// block of 8 rows (the rest 4 at a time) weighs the pairs of all the step's values. The next
// step's rows are asked for column by column.
ATTNKIT_BF16 void group_weigh_bf16(int64_t m, int64_t n, int64_t dv, const float* p, int64_t ld,
                                   RowList<at::BFloat16> x, float* acc, at::BFloat16* w16,
                                   const Ahead<at::BFloat16>& ahead) {
  const int64_t lw = (n + 1) / 2 * 2;  // a row's weights, even: whole pairs
  for (int64_t r = 0; r < m; ++r) {
    row_to_bf16(p + r * ld, n, w16 + r * lw);
    if (lw > n) w16[r * lw + n] = at::BFloat16(0.0f);
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(w16);
  const int64_t tiles = (dv + 31) / 32, eights = m / 8 * 8;
  for (int64_t ct = 0; ct < tiles; ++ct) {
    ahead.for_keys(n * ct / tiles, n * (ct + 1) / tiles, n);
    const int64_t c = 32 * ct;
    for (int64_t r = 0; r < eights; r += 8)
      weigh_rows_bf16<8>(n, w + r * lw / 2, lw / 2, x, c, dv, acc + r * dv, dv);
    row_blocks(m - eights, [&](int64_t r, auto R) {
      weigh_rows_bf16<decltype(R)::value>(n, w + (eights + r) * lw / 2, lw / 2, x, c, dv,
                                          acc + (eights + r) * dv, dv);
    });
  }
}
#endif

}  // namespace
}  // namespace attnkit
