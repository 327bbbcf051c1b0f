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
// latent attention's widths, past L1) for GEMMs. Where AVX512-BF16 has dot products, they are not
// used here: on CPUs that issue one vdpbf16ps (32 products) in the time of four float32 FMAs (64),
// the FMAs on converted rows do the same sums in less time, and keep the weights in float32.
#pragma once

#include "decode_tiles.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

#if defined(CPU_CAPABILITY_AVX512)
// dot_block for rows of R of a block of K keys (K = kb at run time, 1 to 4) of float32 rows.
template <int R>
inline void key_block(int64_t kb, int64_t d, float alpha, const float* a, int64_t lda,
                      const float* const* x, float* s, int64_t ld) {
  switch (kb) {
    case 4:
      dot_block<R, 4>(d, alpha, a, lda, x, s, ld);
      break;
    case 3:
      dot_block<R, 3>(d, alpha, a, lda, x, s, ld);
      break;
    case 2:
      dot_block<R, 2>(d, alpha, a, lda, x, s, ld);
      break;
    default:
      dot_block<R, 1>(d, alpha, a, lda, x, s, ld);
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
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
      const int64_t i = r / 4;
      ahead.for_keys(j + kb * i / blocks, j + kb * (i + 1) / blocks, n);
      key_block<4>(kb, d, alpha, a + r * lda, lda, rows, s + r * ld + j, ld);
    }
    if (r < m) ahead.for_keys(j + kb * (blocks - 1) / blocks, j + kb, n);
    switch (m - r) {
      case 3:
        key_block<3>(kb, d, alpha, a + r * lda, lda, rows, s + r * ld + j, ld);
        break;
      case 2:
        key_block<2>(kb, d, alpha, a + r * lda, lda, rows, s + r * ld + j, ld);
        break;
      case 1:
        key_block<1>(kb, d, alpha, a + r * lda, lda, rows, s + r * ld + j, ld);
        break;
      default:
        break;
    }
  }
}

// Values per block of group_weigh.
constexpr int64_t kGroupValues = 16;

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

}  // namespace
}  // namespace attnkit
