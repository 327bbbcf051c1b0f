// Decoding: a few queries against a long cache, at the speed the cache streams from memory.
//
// The blocked forward runs each query head over all its keys in turn, so the G query heads of a
// key/value head read its keys and values G times, and a call with a few queries has too few query
// blocks to keep the threads busy. Here an item is (batch row, key/value heads, query block, part
// of the keys): it reads each step of its keys and values once, for the queries of every query head
// that shares them (rows ordered (query, head), so that a visit's rows r0:r1 of all heads are one
// stretch), and the parts of one row's keys (split-K) are merged exactly from their log-sum-exps by
// whichever thread finishes the last part, in the same parallel region.
//
// Keys and values are read in place, as pages (X, Hkv, page, D) at any strides: a cache laid out
// (B, Tk, Hkv, D) or (B, Hkv, Tk, D) is one page per batch row, and a paged cache is read through
// its block table, page by page (no gather).
//
// A decode streams the cache from memory as fast as the hardware prefetchers bring it in: they
// follow ascending lines within each 4 KiB page, a few dozen pages at a time. Head-major rows are
// one such stream per head. Token-major rows (flash-attn's layout) hold every head of a token in
// one stretch, so an item reads all its heads, in address order (run_token_step): one head's rows
// alone, Hkv D elements apart, touch a new page every row, far more pages than the prefetchers
// follow, and a decode read so (head by head, each step's rows asked for by software prefetches)
// took 1.5 times as long as on head-major rows (benchmarks/bench_decode.py, cases kvcache and
// modules).
//
// Two entry points: native_forward's calls with one query block (decode, the plan's visits and
// every mask, term and dropout the blocked forward supports), and native_cache_forward, where each
// batch row holds its own stretch of the cache [start, end) and its queries are aligned to its end
// (flash-attn's cache_seqlens and cache_leftpad), masked by a band, key flags and a bias.

#include <memory>

#include "kernel.h"
#include "matrix_unit.h"
#include "position.h"
#include "scores.h"

namespace attnkit {
namespace {

// The products, weighted values and softmax of a step, inlined where they are called: with two
// callers (run_step, run_token_step) GCC leaves them out of line, and a head-major bfloat16
// decode then took 9% longer.
#define ATTNKIT_INLINE inline __attribute__((always_inline))

// Keys per step of an item: the step's scores stay in L1, its keys and values in L2 while all the
// query heads of their key/value heads read them.
constexpr int64_t kStep = 128;
// Query rows (over all heads of an item) up to which the product q k^T runs as dot products here;
// more take a GEMM.
constexpr int64_t kDotRows = 8;
// Keys per step of an item of at most kDotRows rows whose rows are read a head at a time (see
// run_visit): short steps alternate the products of keys and of values, and with them the
// prefetches of the next keys and values (see run_step), often enough to keep memory busy
// through both. Float32 rows gained the most from steps of 16 keys; bfloat16 and float16 rows,
// converted in registers as they are read, gained nothing below 64.
template <typename KV>
constexpr int64_t kFewRowsStep = sizeof(KV) >= 4 ? 16 : 64;
// Keys per step of such an item read token by token (see run_token_step).
constexpr int64_t kTokenStep = 64;
// Keys of a token-major step read for all the item's heads in turn (see run_token_step): two of
// dot_block's blocks of 4, few pages at a time for the prefetchers (of 4, 8 and 16, 8 was the
// fastest for 8 heads of 128 in bfloat16, two tokens to a page, and as fast as 16 in float32).
constexpr int64_t kTokenBlock = 8;
// The stretch within which the hardware prefetchers follow ascending lines: a 4 KiB page.
constexpr int64_t kStreamBytes = 4096;
// A row's keys are split into parts only down to this many keys each.
constexpr int64_t kPartKeys = 512;
// A call starts a thread for every this many bytes of keys and values it reads (see divide).
constexpr int64_t kThreadBytes = int64_t(1) << 20;
// native_forward's calls of at most this many queries (in one query block) take the decode path.
constexpr int64_t kDecodeQueries = 16;

// Keys or values as pages: (X, Hkv, page, D) rows. Without a block table, batch row n is page n and
// holds all its keys; with one, key j of row n is row j % page of page table[n][j / page].
template <typename T>
struct Pages {
  Rows<const T*> x;
  const int64_t* table = nullptr;  // (N, table_ld)
  int64_t table_ld = 0, page = 1;

  const T* at(int64_t n, int64_t hk, int64_t j) const {
    if (table == nullptr) return x.at(n, hk, 0, j);
    return x.at(table[n * table_ld + j / page], hk, 0, j % page);
  }
  // One past the last key of j's page (a row's last key + 1 without a table: e).
  int64_t page_end(int64_t j, int64_t e) const {
    return table == nullptr ? e : std::min(e, j - j % page + page);
  }
  // Whether the rows of one head are further apart than those of one key (a cache laid out
  // (B, Tk, Hkv, D), flash-attn's pages): then one item reads all key/value heads step by step
  // instead of one head's rows a few hundred bytes apart across the whole cache.
  bool token_major() const { return x.s[3] > x.s[1]; }
  // How many tokens of token-major rows share a page of kStreamBytes (1 when a token fills one or
  // more, or when tokens do not divide it).
  int64_t tokens_per_stream() const {
    const int64_t bytes = x.s[3] * int64_t(sizeof(T));
    return bytes > 0 && bytes < kStreamBytes && kStreamBytes % bytes == 0 ? kStreamBytes / bytes
                                                                          : 1;
  }
};

// A decode call: the call (its plan, when the visits come from it), the pages, and how its items
// divide the work. The products are computed in T; keys and values are KV, T itself or, for a
// float32 call, bfloat16 or float16 read as they are (half the bytes) and converted in registers.
template <typename T, typename KV = T>
struct Decode {
  Call<T> c;
  Pages<KV> k, v;
  // (N, 2): row n's keys are [range[2n], range[2n + 1]) and its queries are aligned to the end;
  // null: all Tk keys, the plan's visits.
  const int64_t* range = nullptr;
  // (N, 2): row n's queries are [qrange[2n], qrange[2n] + qrange[2n + 1]) of packed queries
  // (q, out and lse of one batch row, q_total queries); null: q's batch row n, all Tq queries.
  const int64_t* qrange = nullptr;
  int64_t q_total = 0;
  int64_t bq = 1, nqb = 1;  // query rows per block, query blocks
  // Key/value heads per item, their groups, and parts of each row's keys; items per thread.
  int64_t heads = 1, groups = 1, parts = 1, grain = 1;

  int64_t items() const { return c.N * groups * nqb * parts; }
  int64_t q_row(int64_t n) const { return qrange == nullptr ? n : 0; }
  int64_t q_first(int64_t n) const { return qrange == nullptr ? 0 : qrange[2 * n]; }
  int64_t q_len(int64_t n) const { return qrange == nullptr ? c.Tq : qrange[2 * n + 1]; }
  int64_t rows() const { return bq * c.G; }  // an item's rows per key/value head
};

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

// A hint to bring a line into L2. (GCC drops __builtin_prefetch from these loops once they are
// inlined; an asm statement it must keep.)
inline void to_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// The rows of a step's keys or values, wherever they lie (in one stretch of memory, or in pages):
// row j is p[j] + off (off: the key/value head's place beside the first head of the item).
template <typename T>
struct RowList {
  const T* const* p = nullptr;
  int64_t off = 0;
  const T* operator[](int64_t j) const { return p[j] + off; }
};

// The rows of keys and values of the step after this one, asked of memory while this step's
// products run, a row for each of its keys: the hardware's prefetchers alone do not run far enough
// ahead of a core that also computes (a decode then takes the time of its memory traffic plus that
// of its products, instead of the larger of the two), nor across pages.
template <typename X>
struct Ahead {
  RowList<X> k, v;
  int64_t rows = 0, k_bytes = 0, v_bytes = 0;

  void ask(int64_t first, int64_t last) const {
    for (int64_t j = first; j < last; ++j) {
      const char* kr = reinterpret_cast<const char*>(k[j]);
      const char* vr = reinterpret_cast<const char*>(v[j]);
      for (int64_t at = 0; at < k_bytes; at += 64) to_l2(kr + at);
      for (int64_t at = 0; at < v_bytes; at += 64) to_l2(vr + at);
    }
  }
  // The rows that keys [j0, j1) of a step of n keys ask for.
  void for_keys(int64_t j0, int64_t j1, int64_t n) const {
    if (j0 < rows) ask(j0, j1 >= n ? rows : std::min(j1, rows));
  }
};

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
// and shifted into the float's upper half, float16 converted.
template <typename X>
inline __m512 load16(__mmask16 m, const X* x) {
  if constexpr (std::is_same_v<X, float>) {
    return _mm512_maskz_loadu_ps(m, x);
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
template <int R, int K, typename X>
inline void dot_block(int64_t d, float alpha, const float* a, int64_t lda, const X* const* x,
                      float* s, int64_t ld) {
  static_assert(R * K == 16, "a block of 16 dot products");
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
  static_assert(R * K == 16, "a block of 16 dot products");
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
      const T xe = T(x[j][c0]);
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

// One thread's buffers: the item's query rows (heads x rows x Dk, rows ordered (query, head)), a
// step's scores, the position term's window, and the online softmax's state of every row.
template <typename T, typename KV>
struct DecodeBuffers {
  std::vector<T> q, s, pos, acc, m, l;
  // The item's queries in bfloat16 where they are bfloat16 values, the keys are bfloat16 and the
  // CPU has AVX512-BF16 (q16_ok): q k^T then runs on its dot products (see key_dots).
  std::vector<at::BFloat16> q16;
  bool q16_ok = false;
  std::vector<T> t;             // a careful step's terms alone (see run_step)
  std::vector<uint8_t> hidden;  // a careful step's hidden pairs
  // The rows of this step's keys and values, and of the next step's, for the item's first head.
  std::vector<const KV*> keys, values, next_keys, next_values;
  // A step's keys and values in T, for the GEMMs of steps of many rows (keys and values in
  // another dtype than T only).
  std::vector<T> wide_k, wide_v;
  // A token-major step's scores of every head of the item, in the order its keys are read and,
  // when that is another, in the keys' order (see run_token_step); the rows in reading order.
  std::vector<T> read_s, key_s;
  std::vector<const KV*> read_keys, read_values;
  std::vector<int64_t> read_order;
  explicit DecodeBuffers(const Decode<T, KV>& d)
      : q(d.heads * d.rows() * d.c.Dk),
        s(d.rows() * kStep),
        pos(d.c.qv.p == nullptr ? 0 : d.bq * (kStep + d.bq - 1)),
        acc(d.heads * d.rows() * d.c.Dv),
        m(d.heads * d.rows()),
        l(d.heads * d.rows()),
        t(d.rows() * kStep),
        hidden(d.rows() * kStep),
        keys(kStep),
        values(kStep),
        next_keys(kStep),
        next_values(kStep),
        wide_k(std::is_same_v<T, KV> ? 0 : kStep * d.c.Dk),
        wide_v(std::is_same_v<T, KV> ? 0 : kStep * d.c.Dv),
        read_s(d.heads > 1 ? d.heads * kDotRows * kTokenStep : 0),
        key_s(read_s.size()),
        read_keys(d.heads > 1 ? kTokenStep : 0),
        read_values(read_keys.size()),
        read_order(read_keys.size()) {}
};

// Where an item is: batch row, first key/value head and how many, query block and its rows, part.
struct Item {
  int64_t n, hk0, heads, qb, qs, nq, part;
};

template <typename T, typename KV>
Item item_of(const Decode<T, KV>& d, int64_t item) {
  Item it;
  it.part = item % d.parts;
  int64_t rest = item / d.parts;
  it.qb = rest % d.nqb;
  rest /= d.nqb;
  const int64_t gi = rest % d.groups;
  it.n = rest / d.groups;
  it.hk0 = gi * d.heads;
  it.heads = std::min(d.heads, d.c.Hkv - it.hk0);
  it.qs = it.qb * d.bq;
  it.nq = std::max<int64_t>(0, std::min(d.bq, d.q_len(it.n) - it.qs));
  return it;
}

// What follows the product in a step's scores (nr rows of nk keys, rows ordered (query, head)):
// softcap, the position term, the bias and the mask, for each query head (its rows every G-th).
template <typename T, typename KV>
void add_terms(const Call<T>& c, DecodeBuffers<T, KV>& b, int64_t n, int64_t hk, int64_t qs,
               const int64_t* vis, int64_t col0, T* s, int64_t nk) {
  for (int64_t g = 0; g < c.G; ++g) {
    Window<T> w;
    if (c.qv.p != nullptr) {
      w = Window<T>(c, qs, vis[2], vis[3], vis[0], vis[1], b.pos.data());
      w.compute(c, n, hk * c.G + g, qs);
    }
    score_terms(c, n, hk, g, qs, vis, col0, s + g * nk, c.G * nk, static_cast<T*>(nullptr), w,
                false);
  }
}

// Careful steps are for an item whose rows came out NaN or inf (q, k or v hold NaN or inf: the
// decode path does not read them beforehand). A pair the mask or a -inf bias hides must not reach
// any output, but 0 * inf in the product with the values is NaN, and NaN + -inf is NaN: the hidden
// pairs get the score -inf whatever their product, and are left out of the weighted values. acc
// rows (nr, dv wide) += p x for the pairs each row sees (hidden[r][j] == 0); a NaN or inf value a
// row sees makes that dimension of its output NaN, whatever its weight (the non-finite policy: the
// reference gives NaN there, also where the weight underflows to 0).
template <typename T, typename X>
void weigh_seen(int64_t nr, int64_t nk, int64_t dv, const T* p, const uint8_t* hidden, RowList<X> x,
                T* acc) {
  using V = at::vec::Vectorized<T>;
  const V zero(T(0));
  for (int64_t r = 0; r < nr; ++r) {
    T* o = acc + r * dv;
    for (int64_t j = 0; j < nk; ++j) {
      if (hidden[r * nk + j]) continue;
      const V w(p[r * nk + j]);
      const X* xr = x[j];
      int64_t e = 0;
      for (; e + V::size() <= dv; e += V::size()) {
        const V xv = load_as<T>(xr + e);  // xv * 0: 0, or NaN where xv is NaN or inf
        (at::vec::fmadd(w, xv, V::loadu(o + e)) + xv * zero).store(o + e);
      }
      for (; e < dv; ++e) o[e] += p[r * nk + j] * T(xr[e]) + T(xr[e]) * T(0);
    }
  }
}

// A step's nk rows of keys or values (of width w, from key ks of head (n, hk)) for a GEMM: where
// they are, at their stride, when they are T; else converted into wide (nk x w). ld: their stride.
template <typename T, typename KV>
const T* rows_in(const Pages<KV>& x, RowList<KV> rows, int64_t n, int64_t hk, int64_t ks,
                 int64_t nk, int64_t w, T* wide, int64_t& ld) {
  if constexpr (std::is_same_v<T, KV>) {
    ld = x.x.ld();
    return x.at(n, hk, ks);
  } else {
    for (int64_t j = 0; j < nk; ++j) convert_row(rows[j], w, wide + j * w);
    ld = w;
    return wide;
  }
}

// The online softmax of a step's scores s (rows vis[2]:vis[3] of the query block at qs, each for
// the G query heads of head (n, hk), of keys [vis[0], vis[1]), terms added): the rows' running
// maxima m and sums l, their weighted values acc rescaled to the new maxima, s made the weights
// (dropped where dropout drops).
template <typename T>
ATTNKIT_INLINE void softmax_step(const Call<T>& c, int64_t n, int64_t hk, int64_t qs, const int64_t* vis, T* s,
                  T* acc, T* m, T* l) {
  const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], r1 = vis[3], G = c.G;
  for (int64_t r = 0; r < (r1 - r0) * G; ++r) {
    T* row = s + r * nk;
    const T mnew = std::max(m[r], row_max(row, nk));
    const T safe = std::isinf(mnew) && mnew < 0 ? T(0) : mnew;
    const T scale = std::exp2(m[r] - safe);
    l[r] = l[r] * scale + exp2_sum(row, nk, safe);
    if (scale != T(1)) scale_row(acc + r * c.Dv, c.Dv, scale);
    m[r] = mnew;
  }
  if (c.p_drop > 0) {
    for (int64_t g = 0; g < G; ++g)
      drop(c, n, hk * G + g, qs + r0, ks, r1 - r0, nk, s + g * nk, G * nk);
  }
}

// s (nr x nk, ld) = alpha * the item's query rows from q0 (of b.q) x the keys^T: dots, or
// dots_bf16 where the queries are bfloat16 values and the keys bfloat16 (b.q16_ok).
template <typename T, typename KV>
ATTNKIT_INLINE void key_dots(const DecodeBuffers<T, KV>& b, int64_t q0, int64_t nr, int64_t nk,
                             int64_t dk, T alpha, RowList<KV> keys, T* s, int64_t ld,
                             const Ahead<KV>& ahead) {
#if defined(ATTNKIT_MATRIX_UNIT)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<KV, at::BFloat16>) {
    if (b.q16_ok) {
      dots_bf16(nr, nk, dk, alpha, b.q16.data() + q0, b.q.data() + q0, dk, keys, s, ld, ahead);
      return;
    }
  }
#endif
  dots<T>(nr, nk, dk, alpha, b.q.data() + q0, dk, keys, s, ld, ahead);
}

// One step of keys [vis[0], vis[1]) for rows vis[2]:vis[3] of the query block at qs of head (n,
// hk), hh the head's place in its item: scores, online softmax, dropout, weighted values. keys and
// values: the step's rows; ahead: the next step's, asked for while these products run.
template <typename T, typename KV>
void run_step(const Decode<T, KV>& d, const Call<T>& c, DecodeBuffers<T, KV>& b, int64_t n,
              int64_t hk, int64_t hh, int64_t qs, const int64_t* vis, int64_t col0,
              RowList<KV> keys, RowList<KV> values, const Ahead<KV>& ahead, bool careful) {
  const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], r1 = vis[3];
  const int64_t G = c.G, R = d.rows(), first = r0 * G, nr = (r1 - r0) * G;
  T* s = b.s.data();
  const T* qrows = b.q.data() + (hh * R + first) * c.Dk;
  const T alpha = product_factor(c);
  const bool few = nr <= kDotRows;
  // Few rows: the next keys are asked for during this step's key products and the next values
  // during its value products (where weigh can): asked for in one burst, the lines queue behind
  // each other and stall the products they run beside; spread over both passes, the memory
  // traffic overlaps the products of both.
  const bool split = few && !careful && kWeighAsks<T>;
  Ahead<KV> next_keys = ahead, next_values;
  if (split) {
    next_keys.v_bytes = 0;
    next_values = ahead;
    next_values.k_bytes = 0;
  }
  if (few) {
    key_dots(b, (hh * R + first) * c.Dk, nr, nk, c.Dk, alpha, keys, s, nk, next_keys);
  } else {  // the step lies in one page (see run_visit)
    ahead.for_keys(0, nk, nk);
    int64_t ld = 0;
    const T* k = rows_in<T>(d.k, keys, n, hk, ks, nk, c.Dk, b.wide_k.data(), ld);
    gemm<T>(c.register_tiles, false, true, nr, nk, c.Dk, alpha, qrows, c.Dk, k, ld, T(0), s, nk);
  }
  if (c.softcap > 0 || c.bias != nullptr || c.qv.p != nullptr || vis[4]) {
    add_terms(c, b, n, hk, qs, vis, col0, s, nk);
  }
  if (careful) {
    // The pairs the mask or a -inf bias hides: the terms on products of 0 are -inf exactly there.
    T* z = b.t.data();
    std::fill(z, z + nr * nk, T(0));
    add_terms(c, b, n, hk, qs, vis, col0, z, nk);
    for (int64_t x = 0; x < nr * nk; ++x) {
      b.hidden[x] = z[x] == -std::numeric_limits<T>::infinity();
      if (b.hidden[x]) s[x] = z[x];  // also where the product is NaN
    }
  }
  T* acc = b.acc.data() + (hh * R + first) * c.Dv;
  softmax_step(c, n, hk, qs, vis, s, acc, b.m.data() + hh * R + first, b.l.data() + hh * R + first);
  if (careful) {
    weigh_seen(nr, nk, c.Dv, s, b.hidden.data(), values, acc);
  } else if (few) {
    weigh<T>(nr, nk, c.Dv, s, nk, values, acc, next_values);
  } else {
    int64_t ld = 0;
    const T* v = rows_in<T>(d.v, values, n, hk, ks, nk, c.Dv, b.wide_v.data(), ld);
    gemm<T>(c.register_tiles, false, false, nr, c.Dv, nk, T(1), s, nk, v, ld, T(1), acc, c.Dv);
  }
}

// The rows of keys [j0, j1) of (n, hk): out[j - j0].
template <typename T>
void rows_of_keys(const Pages<T>& x, int64_t n, int64_t hk, int64_t j0, int64_t j1, const T** out) {
  for (int64_t j = j0; j < j1;) {
    const int64_t e = x.page_end(j, j1), ld = x.x.ld();
    const T* p = x.at(n, hk, j);
    for (int64_t i = j; i < e; ++i) out[i - j0] = p + (i - j) * ld;
    j = e;
  }
}

// One step of a token-major item of few rows (vis and col0 as run_step's): the products of every
// head of the item, then each head's softmax, then every head's weighted values, each over blocks
// of kTokenBlock keys, a block read for all the heads in turn, so that the rows come in address
// order (see the top of this file). Where P tokens share a page, a block of consecutive keys would
// still go back and forth in each page (a head of every token, then the next head of every
// token): the keys are then read in groups of kTokenBlock P, the tokens at place o of their pages
// for o = 0, ..., P - 1 in turn, each block of kTokenBlock from as many pages. The scores come in
// that order; the terms and dropout, which depend on the keys' positions, take them in the keys'
// own.
template <typename T, typename KV>
void run_token_step(const Decode<T, KV>& d, const Call<T>& c, DecodeBuffers<T, KV>& b,
                    const Item& it, const int64_t* vis, int64_t col0) {
  const int64_t nk = vis[1] - vis[0], R = d.rows(), first = vis[2] * c.G;
  const int64_t nr = (vis[3] - vis[2]) * c.G, P = d.k.tokens_per_stream();
  const KV* const* keys = b.keys.data();
  const KV* const* values = b.values.data();
  const int64_t* order = b.read_order.data();  // order[j]: the key read j-th
  if (P > 1) {
    int64_t x = 0;
    for (int64_t g = 0; g < nk; g += kTokenBlock * P) {
      const int64_t end = std::min(nk, g + kTokenBlock * P);
      for (int64_t o = 0; o < P; ++o)
        for (int64_t j = g + o; j < end; j += P) b.read_order[x++] = j;
    }
    for (int64_t j = 0; j < nk; ++j) {
      b.read_keys[j] = b.keys[order[j]];
      b.read_values[j] = b.values[order[j]];
    }
    keys = b.read_keys.data();
    values = b.read_values.data();
  }
  const bool terms = c.softcap > 0 || c.bias != nullptr || c.qv.p != nullptr || vis[4];
  const bool reordered = P > 1 && (terms || c.p_drop > 0);
  T* s = b.read_s.data();  // head hh's scores: nr rows of nk from s + hh nr nk
  const T alpha = product_factor(c);
  for (int64_t j0 = 0; j0 < nk; j0 += kTokenBlock) {
    const int64_t nb = std::min(kTokenBlock, nk - j0);
    for (int64_t hh = 0; hh < it.heads; ++hh) {
      key_dots(b, (hh * R + first) * c.Dk, nr, nb, c.Dk, alpha,
               RowList<KV>{keys + j0, hh * d.k.x.s[1]}, s + hh * nr * nk + j0, nk, Ahead<KV>{});
    }
  }
  T* w = s;  // the scores in the keys' order
  if (reordered) {
    w = b.key_s.data();
    for (int64_t x = 0; x < it.heads * nr; ++x)
      for (int64_t j = 0; j < nk; ++j) w[x * nk + order[j]] = s[x * nk + j];
  }
  for (int64_t hh = 0; hh < it.heads; ++hh) {
    const int64_t hk = it.hk0 + hh, x0 = hh * R + first;
    T* sh = w + hh * nr * nk;
    if (terms) add_terms(c, b, it.n, hk, it.qs, vis, col0, sh, nk);
    softmax_step(c, it.n, hk, it.qs, vis, sh, b.acc.data() + x0 * c.Dv, b.m.data() + x0,
                 b.l.data() + x0);
  }
  if (reordered) {
    for (int64_t x = 0; x < it.heads * nr; ++x)
      for (int64_t j = 0; j < nk; ++j) s[x * nk + j] = w[x * nk + order[j]];
  }
  for (int64_t j0 = 0; j0 < nk; j0 += kTokenBlock) {
    const int64_t nb = std::min(kTokenBlock, nk - j0);
    for (int64_t hh = 0; hh < it.heads; ++hh) {
      weigh<T>(nr, nb, c.Dv, s + hh * nr * nk + j0, nk, RowList<KV>{values + j0, hh * d.v.x.s[1]},
               b.acc.data() + (hh * R + first) * c.Dv, Ahead<KV>{});
    }
  }
}

// The part's stretch of keys [first, last) of a visit's keys [ks, ke), in steps, for each
// key/value head of the item. Steps of few rows span pages (their products read rows wherever
// they lie); others are cut at pages (their GEMMs read rows at one stride).
template <typename T, typename KV>
void run_visit(const Decode<T, KV>& d, const Call<T>& c, DecodeBuffers<T, KV>& b, const Item& it,
               const int64_t* vis, int64_t first, int64_t last, bool careful) {
  const bool few = (vis[3] - vis[2]) * c.G <= kDotRows;
  // Token-major rows: every head of a block of keys in turn, in address order, for the hardware
  // prefetchers (see the top of this file), rather than software prefetches a head at a time; a
  // careful step goes head by head.
  const bool by_token = few && !careful && it.heads > 1;
  // Few rows take shorter steps (see kFewRowsStep).
  const int64_t len = by_token ? kTokenStep : few ? kFewRowsStep<KV> : kStep;
  auto end_of = [&](int64_t ks) {
    const int64_t e = std::min(last, ks + len);
    return few ? e : d.k.page_end(ks, e);
  };
  const int64_t n = it.n, hk0 = it.hk0;
  int64_t ks = first, ke = end_of(first);
  rows_of_keys(d.k, n, hk0, ks, ke, b.keys.data());
  rows_of_keys(d.v, n, hk0, ks, ke, b.values.data());
  while (ks < last) {
    const int64_t after = ke < last ? end_of(ke) : ke;
    rows_of_keys(d.k, n, hk0, ke, after, b.next_keys.data());
    rows_of_keys(d.v, n, hk0, ke, after, b.next_values.data());
    int64_t step[6] = {ks, ke, vis[2], vis[3], vis[4], vis[5]};
    // A band alone: a step every row sees whole needs no mask.
    if (step[4] && c.band && c.key_ok == nullptr && c.tiles == nullptr) {
      const double a = double(it.qs + vis[3] - 1 + c.shift) + c.lo;  // last row's first key
      const double z = double(it.qs + vis[2] + c.shift) + c.hi;      // first row's last key
      if (a <= double(ks) && z >= double(ke - 1)) step[4] = 0;
    }
    if (by_token) {
      // The first line of each of the next step's tokens, asked for now: pages of a few tokens
      // lie anywhere, and the hardware's prefetchers start a stream only after a page's first
      // misses.
      for (int64_t j = 0; j < after - ke; ++j) {
        to_l2(reinterpret_cast<const char*>(b.next_keys[j]));
        to_l2(reinterpret_cast<const char*>(b.next_values[j]));
      }
      run_token_step(d, c, b, it, step, ks - vis[0]);
    } else {
      for (int64_t hh = 0; hh < it.heads; ++hh) {
        const int64_t ko = hh * d.k.x.s[1], vo = hh * d.v.x.s[1];  // head hk0 + hh's rows
        Ahead<KV> ahead;
        ahead.k = {b.next_keys.data(), ko};
        ahead.v = {b.next_values.data(), vo};
        ahead.rows = after - ke;
        ahead.k_bytes = c.Dk * int64_t(sizeof(KV));
        ahead.v_bytes = c.Dv * int64_t(sizeof(KV));
        run_step(d, c, b, n, hk0 + hh, hh, it.qs, step, ks - vis[0],
                 RowList<KV>{b.keys.data(), ko}, RowList<KV>{b.values.data(), vo}, ahead, careful);
      }
    }
    std::swap(b.keys, b.next_keys);
    std::swap(b.values, b.next_values);
    ks = ke;
    ke = after;
  }
}

// Part p of P of the keys [k0, k1): its stretch, cut at multiples of 16 keys.
inline void part_of(int64_t k0, int64_t k1, int64_t p, int64_t P, int64_t& a, int64_t& z) {
  auto cut = [&](int64_t x) {
    if (x <= 0) return k0;
    if (x >= P) return k1;
    const int64_t at = k0 + (k1 - k0) * x / P;
    return std::max(k0, at - at % 16);
  };
  a = cut(p);
  z = cut(p + 1);
}

// A row's out and lse from its (m, l, acc) in base 2: a row that sees no key gets zeros and -inf, a
// NaN sum (a NaN or +inf score it sees) NaN, as in the blocked forward.
template <typename T>
void write_row(T m, T l, const T* acc, int64_t dv, T* o, T* lse) {
  if (l > T(0) || std::isnan(l)) {
    const T inv = T(1) / l;
    for (int64_t e = 0; e < dv; ++e) o[e] = acc[e] * inv;
    *lse = T((m + std::log2(l)) * kLn2);
  } else {
    // Nothing seen: 0, or NaN in a dimension where a key the mask lets the row see holds a NaN or
    // inf value (a careful item, see weigh_seen).
    for (int64_t e = 0; e < dv; ++e) o[e] = acc[e] * T(0);
    *lse = -std::numeric_limits<T>::infinity();
  }
}

// Where the parts of the items keep (acc, m, l) until the last of them merges them.
template <typename T>
struct Parts {
  std::vector<T> buf;
  std::unique_ptr<std::atomic<int64_t>[]> done;
  int64_t stride = 0;  // per item: heads x rows x (Dv + 2)

  template <typename KV>
  explicit Parts(const Decode<T, KV>& d) {
    if (d.parts == 1) return;
    stride = d.heads * d.rows() * (d.c.Dv + 2);
    buf.resize(size_t(d.items() * stride));
    done.reset(new std::atomic<int64_t>[size_t(d.items() / d.parts)]());
  }
  T* acc(int64_t item) { return buf.data() + item * stride; }
  template <typename KV>
  T* m(const Decode<T, KV>& d, int64_t item) {
    return acc(item) + d.heads * d.rows() * d.c.Dv;
  }
  template <typename KV>
  T* l(const Decode<T, KV>& d, int64_t item) {
    return m(d, item) + d.heads * d.rows();
  }
};

// The item's rows: written to out and lse when it is the only part, else kept, and merged with the
// other parts' by the thread that finishes the last of them.
template <typename T, typename KV>
void finish_item(const Decode<T, KV>& d, DecodeBuffers<T, KV>& b, Parts<T>& parts, int64_t item,
                 const Item& it, const Rows<T*>& out, T* lse) {
  const Call<T>& c = d.c;
  const int64_t G = c.G, R = d.rows(), Dv = c.Dv;
  auto lse_at = [&](int64_t hk, int64_t g, int64_t i) {
    return lse + ((d.q_row(it.n) * c.Hkv + hk) * G + g) * d.q_total + d.q_first(it.n) + i;
  };
  if (d.parts == 1) {
    for (int64_t hh = 0; hh < it.heads; ++hh) {
      for (int64_t r = 0; r < it.nq * G; ++r) {
        const int64_t x = hh * R + r, hk = it.hk0 + hh, g = r % G, i = it.qs + r / G;
        write_row(b.m[x], b.l[x], b.acc.data() + x * Dv, Dv,
                  out.at(d.q_row(it.n), hk, g, d.q_first(it.n) + i), lse_at(hk, g, i));
      }
    }
    return;
  }
  std::copy(b.acc.begin(), b.acc.end(), parts.acc(item));
  std::copy(b.m.begin(), b.m.end(), parts.m(d, item));
  std::copy(b.l.begin(), b.l.end(), parts.l(d, item));
  const int64_t group = item / d.parts;
  if (parts.done[group].fetch_add(1, std::memory_order_acq_rel) != d.parts - 1) return;
  const int64_t item0 = group * d.parts;
  std::vector<T> o(Dv);
  for (int64_t hh = 0; hh < it.heads; ++hh) {
    for (int64_t r = 0; r < it.nq * G; ++r) {
      const int64_t x = hh * R + r, hk = it.hk0 + hh, g = r % G, i = it.qs + r / G;
      T top = -std::numeric_limits<T>::infinity();
      for (int64_t p = 0; p < d.parts; ++p) top = std::max(top, parts.m(d, item0 + p)[x]);
      const T safe = std::isinf(top) && top < 0 ? T(0) : top;
      T l = 0;
      std::fill(o.begin(), o.end(), T(0));
      for (int64_t p = 0; p < d.parts; ++p) {
        const T w = std::exp2(parts.m(d, item0 + p)[x] - safe);  // 0 for a part that saw nothing
        l += parts.l(d, item0 + p)[x] * w;
        const T* a = parts.acc(item0 + p) + x * Dv;
        for (int64_t e = 0; e < Dv; ++e) o[e] += a[e] * w;
      }
      write_row(top, l, o.data(), Dv, out.at(d.q_row(it.n), hk, g, d.q_first(it.n) + i),
                lse_at(hk, g, i));
    }
  }
}

// The item's query rows, (query, head) ordered, contiguous, for each of its key/value heads.
template <typename T, typename KV>
void load_queries(const Decode<T, KV>& d, DecodeBuffers<T, KV>& b, const Item& it) {
  const Call<T>& c = d.c;
  for (int64_t hh = 0; hh < it.heads; ++hh) {
    for (int64_t i = 0; i < it.nq; ++i) {
      for (int64_t g = 0; g < c.G; ++g) {
        const T* src = c.q.at(d.q_row(it.n), it.hk0 + hh, g, d.q_first(it.n) + it.qs + i);
        std::copy(src, src + c.Dk, b.q.data() + ((hh * d.rows()) + i * c.G + g) * c.Dk);
      }
    }
  }
#if defined(ATTNKIT_MATRIX_UNIT)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<KV, at::BFloat16>) {
    b.q16_ok = has_bf16_dot();
    b.q16.resize(b.q.size());
    for (int64_t hh = 0; hh < it.heads && b.q16_ok; ++hh) {
      const int64_t at = hh * d.rows() * c.Dk;
      b.q16_ok = to_bf16_exact(b.q.data() + at, it.nq * c.G * c.Dk, b.q16.data() + at);
    }
  }
#endif
}

// Row n's keys the query block at qs (nq rows) may see under the band, within [start, end).
template <typename T>
void visible_keys(const Call<T>& c, int64_t start, int64_t end, int64_t qs, int64_t nq, int64_t& k0,
                  int64_t& k1) {
  k0 = start, k1 = end;
  if (c.band) {
    const double lo = double(qs + c.shift) + c.lo, hi = double(qs + nq - 1 + c.shift) + c.hi;
    if (lo > double(k0)) k0 = lo >= double(end) ? end : int64_t(std::ceil(lo));
    if (hi < double(k1 - 1)) k1 = hi < double(start) ? start : int64_t(std::floor(hi)) + 1;
  }
  if (k1 < k0) k1 = k0;
}

// Every visit of the item's part of the keys, from a fresh state.
template <typename T, typename KV>
void run_item(const Decode<T, KV>& d, DecodeBuffers<T, KV>& b, const Item& it, bool careful) {
  std::fill(b.acc.begin(), b.acc.end(), T(0));
  std::fill(b.m.begin(), b.m.end(), -std::numeric_limits<T>::infinity());
  std::fill(b.l.begin(), b.l.end(), T(0));
  if (d.range == nullptr) {  // the plan's visits (one query block)
    const Call<T>& c = d.c;
    int64_t k0 = c.Tk, k1 = 0;
    for (int64_t vi = c.off[0]; vi < c.off[1]; ++vi) {
      k0 = std::min(k0, c.visits[vi * 6]);
      k1 = std::max(k1, c.visits[vi * 6 + 1]);
    }
    int64_t a = 0, z = 0;
    part_of(k0, k1, it.part, d.parts, a, z);
    for (int64_t vi = c.off[0]; vi < c.off[1]; ++vi) {
      const int64_t* vis = c.visits + vi * 6;
      const int64_t first = std::max(vis[0], a), last = std::min(vis[1], z);
      if (first < last) run_visit(d, c, b, it, vis, first, last, careful);
    }
    return;
  }
  // The row's own keys, its queries aligned to their end.
  if (it.nq == 0) return;
  const int64_t start = d.range[2 * it.n], end = d.range[2 * it.n + 1], len = d.q_len(it.n);
  Call<T> c = d.c;
  c.shift = end - len;
  // A bias by distance reads the distance from the row's own alignment.
  if (c.bias_aliased) c.bias += ((c.Tk - end) - (c.Tq - len)) * c.bs[4];
  int64_t k0, k1;
  visible_keys(c, start, end, it.qs, it.nq, k0, k1);
  int64_t a = 0, z = 0;
  part_of(k0, k1, it.part, d.parts, a, z);
  const int64_t vis[6] = {k0, k1, 0, it.nq, c.band || c.key_ok != nullptr, -1};
  if (a < z) run_visit(d, c, b, it, vis, a, z, careful);
}

// Whether every row of the item has a finite state (sum and weighted values).
template <typename T, typename KV>
bool finite_rows(const Decode<T, KV>& d, const DecodeBuffers<T, KV>& b, const Item& it) {
  using V = at::vec::Vectorized<T>;
  V zero(T(0));  // x * 0 is 0 for finite x, NaN for NaN and inf
  T rest = 0;
  for (int64_t hh = 0; hh < it.heads; ++hh) {
    const int64_t x0 = hh * d.rows(), n = it.nq * d.c.G;
    for (int64_t x = x0; x < x0 + n; ++x) rest += b.l[x] * T(0);
    const T* a = b.acc.data() + x0 * d.c.Dv;
    const int64_t len = n * d.c.Dv;
    int64_t e = 0;
    for (; e + V::size() <= len; e += V::size())
      zero = at::vec::fmadd(V::loadu(a + e), V(T(0)), zero);
    for (; e < len; ++e) rest += a[e] * T(0);
  }
  T lanes[V::size()];
  zero.store(lanes);
  for (int64_t i = 0; i < V::size(); ++i) rest += lanes[i];
  return rest == T(0);
}

template <typename T, typename KV>
void decode_impl(const Decode<T, KV>& d, const Rows<T*>& out, T* lse) {
  const int64_t items = d.items();
  Parts<T> parts(d);
  std::atomic<int64_t> next{0};  // items are claimed one at a time (see claim)
  at::parallel_for(0, items, d.grain, [&](int64_t, int64_t) {
    OneBlasThread one;
    DecodeBuffers<T, KV> b(d);
    for (int64_t item = claim(next); item < items; item = claim(next)) {
      const Item it = item_of(d, item);
      load_queries(d, b, it);
      run_item(d, b, it, false);
      // NaN or inf in q, k or v: again, carefully (see add_terms).
      if (!finite_rows(d, b, it)) run_item(d, b, it, true);
      finish_item(d, b, parts, item, it, out, lse);
    }
  });
}

// Items: all key/value heads together where rows are token-major, else one each; parts of each
// row's keys until there are a few items per thread, each part at least kPartKeys keys.
template <typename T, typename KV>
void divide(Decode<T, KV>& d, int64_t span) {
  d.heads = d.k.token_major() && d.v.token_major() ? d.c.Hkv : 1;
  d.groups = (d.c.Hkv + d.heads - 1) / d.heads;
  const int64_t base = d.c.N * d.groups * d.nqb;
  const int64_t want = 4 * int64_t(at::get_num_threads());
  d.parts = 1;
  if (base > 0 && base < want) {
    d.parts = std::max<int64_t>(1, std::min((want + base - 1) / base, span / kPartKeys));
  }
  // A thread for at least kThreadBytes of keys and values: starting another costs more than a
  // small call (and on a busy core, where it may wait for a time slice, far more).
  const int64_t item_bytes =
      std::max<int64_t>(1, (span / d.parts) * d.heads * (d.c.Dk + d.c.Dv) * int64_t(sizeof(KV)));
  d.grain = std::max<int64_t>(1, kThreadBytes / item_bytes);
}

template <typename T>
Pages<T> pages_of(const at::Tensor& x) {
  Pages<T> p;
  p.x = rows_of<const T*>(x, x.data_ptr<T>());
  p.page = std::max<int64_t>(x.size(2), 1);
  return p;
}

}  // namespace

bool decodes(const CallArgs& a) {
  return a.q.dim() == 5 && a.q.size(3) <= std::min<int64_t>(a.block_q, kDecodeQueries);
}

std::tuple<at::Tensor, at::Tensor> decode(const CallArgs& a) {
  TORCH_CHECK(a.q.dim() == 5 && a.v.dim() == 4,
              "attnkit: q must be (N, Hkv, G, Tq, Dk) and v (N, Hkv, Tk, Dv), got ", a.q.sizes(),
              " and ", a.v.sizes());
  at::Tensor out = like_q(a.q, a.v.size(3));
  at::Tensor lse = at::empty({a.q.size(0), a.q.size(1), a.q.size(2), a.q.size(3)}, a.q.options());
  with_kv_types(a.q, a.k, "attnkit::native_forward", [&](auto t, auto kv) {
    using T = decltype(t);
    using KV = decltype(kv);
    Decode<T, KV> d;
    d.c = make_call<T>(a);
    TORCH_CHECK(d.c.nqb <= 1, "attnkit: a decode call has one query block, got ", d.c.nqb);
    if (d.c.nqb == 0 || d.c.N * d.c.Hkv * d.c.G == 0) return;
    d.k = pages_of<KV>(a.k);
    d.v = pages_of<KV>(a.v);
    d.bq = d.c.Tq;
    d.nqb = 1;
    d.q_total = d.c.Tq;
    int64_t k0 = d.c.Tk, k1 = 0;
    for (int64_t vi = d.c.off[0]; vi < d.c.off[1]; ++vi) {
      k0 = std::min(k0, d.c.visits[vi * 6]);
      k1 = std::max(k1, d.c.visits[vi * 6 + 1]);
    }
    divide(d, k1 - k0);
    decode_impl(d, rows_of<T*>(out, out.data_ptr<T>()), lse.data_ptr<T>());
  });
  return {out, lse};
}

// A (N, 2) int64 tensor of a stretch per row, or null.
const int64_t* stretches(const c10::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 2 && t->size(0) == N &&
                  t->size(1) == 2 && t->is_contiguous(),
              "attnkit: ", name, " must be contiguous int64 (N, 2) with N = ", N, ", got ",
              t->scalar_type(), " ", t->sizes());
  return t->data_ptr<int64_t>();
}

std::tuple<at::Tensor, at::Tensor> cache_forward(const CacheArgs& a) {
  const at::Tensor &q = a.q, &k = a.k, &v = a.v;
  TORCH_CHECK(q.dim() == 5 && k.dim() == 4 && v.dim() == 4,
              "attnkit: q must be (N, Hkv, G, Tq, Dk) and k, v pages (X, Hkv, page, D), got q of ",
              q.dim(), " dimensions, k of ", k.dim(), ", v of ", v.dim());
  check_dtypes(q, k, v);
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "attnkit: the native kernel runs on CPU tensors");
  TORCH_CHECK(k.size(1) == q.size(1) && v.size(1) == q.size(1) && k.size(3) == q.size(4) &&
                  v.size(0) == k.size(0) && v.size(2) == k.size(2),
              "attnkit: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " do not fit together (k and v: the same pages, Hkv heads, k's width q's)");
  TORCH_CHECK(a.block_q > 0, "attnkit: block_q must be positive, got ", a.block_q);
  // The rows: q's batch rows, or the stretches of packed queries (q of one batch row).
  const bool packed = a.q_range.has_value();
  const int64_t N = packed ? a.q_range->size(0) : q.size(0), page = k.size(2);
  const int64_t* qrange = stretches(a.q_range, N, "q_range");
  TORCH_CHECK(!packed || q.size(0) == 1, "attnkit: with q_range, q holds one batch row of packed ",
              "queries, got ", q.sizes());
  int64_t q_len = packed ? 0 : q.size(3);
  for (int64_t n = 0, after = 0; n < N && packed; ++n) {
    const int64_t first = qrange[2 * n], len = qrange[2 * n + 1];
    TORCH_CHECK(first >= after && len >= 0 && first + len <= q.size(3), "attnkit: row ", n,
                "'s queries ", first, ":", first + len, " overlap the previous row's or lie ",
                "outside q's ", q.size(3));
    after = first + len;
    q_len = std::max(q_len, len);
  }
  int64_t capacity = page;
  const int64_t* table = nullptr;
  if (a.block_table.has_value()) {
    const at::Tensor& t = *a.block_table;
    TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 2 && t.is_contiguous() && t.size(0) == N,
                "attnkit: block_table must be contiguous int64 (N, pages) with N = ", N, ", got ",
                t.scalar_type(), " ", t.sizes());
    table = t.data_ptr<int64_t>();
    capacity = t.size(1) * page;
  } else {
    TORCH_CHECK(k.size(0) == N,
                "attnkit: without a block table, k and v hold one page per row: ", N, " rows, got ",
                k.size(0));
  }
  std::vector<int64_t> whole;
  const int64_t* range = stretches(a.kv_range, N, "kv_range");
  if (range == nullptr) {
    whole.resize(size_t(2 * N));
    for (int64_t n = 0; n < N; ++n) whole[2 * n] = 0, whole[2 * n + 1] = capacity;
    range = whole.data();
  }
  // Every page a row's keys lie in must be a page of k and v: the kernel follows the table.
  int64_t kv_len = 0;  // the call's keys: the longest row's
  for (int64_t n = 0; n < N; ++n) {
    const int64_t start = range[2 * n], end = range[2 * n + 1];
    TORCH_CHECK(0 <= start && start <= end && end <= capacity, "attnkit: row ", n, "'s keys ",
                start, ":", end, " lie outside its ", capacity, " positions");
    for (int64_t p = start / page; table != nullptr && p * page < end; ++p) {
      const int64_t at = table[n * (capacity / page) + p];
      TORCH_CHECK(0 <= at && at < k.size(0), "attnkit: block_table[", n, ", ", p, "] = ", at,
                  " is not a page: k and v hold ", k.size(0));
    }
    kv_len = std::max(kv_len, end);
  }
  TORCH_CHECK(!packed || !a.bias.has_value() || !a.bias_layout.empty(),
              "attnkit: packed queries take a bias by distance, not a dense bias");
  at::Tensor out = like_q(q, v.size(3));
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  if (packed) {  // queries no row holds: no key
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
  }
  with_kv_types(q, k, "attnkit::native_cache_forward", [&](auto t, auto kv) {
    using T = decltype(t);
    using KV = decltype(kv);
    Decode<T, KV> d;
    Call<T>& c = d.c;
    c.N = N;
    c.Hkv = q.size(1);
    c.G = q.size(2);
    c.Tq = q_len;
    c.Dk = q.size(4);
    c.Tk = kv_len;
    c.Dv = v.size(3);
    c.bq = std::min<int64_t>(a.block_q, std::max<int64_t>(q_len, 1));
    c.q = rows_of<const T*>(q, q.data_ptr<T>());
    c.scale = a.scale;
    c.softcap = a.softcap;
    c.register_tiles = a.register_tiles;
    CallArgs bias_args;  // read_bias reads the bias and its layout from these
    bias_args.q = q;
    bias_args.bias = a.bias;
    bias_args.bias_layout = a.bias_layout;
    read_bias(bias_args, c);
    if (c.bias_aliased) {
      // Each row reads its distances from its own alignment: every element it reads in the table.
      const int64_t numel = a.bias->numel();
      for (int64_t n = 0; n < N; ++n) {
        const int64_t start = range[2 * n], end = range[2 * n + 1];
        const int64_t len = packed ? qrange[2 * n + 1] : q_len;
        if (start == end || len == 0) continue;
        const int64_t first[5] = {n, 0, 0, 0, start},
                      last[5] = {n, c.Hkv - 1, c.G - 1, len - 1, end - 1};
        int64_t lo = a.bias_layout[5] + ((kv_len - end) - (q_len - len)) * c.bs[4], hi = lo;
        for (int i = 0; i < 5; ++i) {
          lo += std::min(first[i] * c.bs[i], last[i] * c.bs[i]);
          hi += std::max(first[i] * c.bs[i], last[i] * c.bs[i]);
        }
        TORCH_CHECK(lo >= 0 && hi < numel, "attnkit: row ", n, " reads elements ", lo, " to ", hi,
                    " of a bias table of ", numel);
      }
    }
    if (a.band.size() == 2) {
      c.band = true;
      c.lo = a.band[0];
      c.hi = a.band[1];
    } else {
      TORCH_CHECK(a.band.empty(), "attnkit: band is [lo, hi] or empty, got ", a.band.size(),
                  " numbers");
    }
    if (a.key_ok.has_value()) {
      const at::Tensor& f = *a.key_ok;
      TORCH_CHECK(f.scalar_type() == at::kByte && f.dim() == 2 && f.is_contiguous() &&
                      (f.size(0) == 1 || f.size(0) == N) && f.size(1) == kv_len,
                  "attnkit: key_ok must be contiguous uint8 (N or 1, Tk) = (", N, ", ", kv_len,
                  "), Tk the longest row's end, got ", f.scalar_type(), " ", f.sizes());
      c.key_ok = f.data_ptr<uint8_t>();
      c.key_rows = f.size(0);
    }
    if (N * c.Hkv * c.G * q_len == 0) return;
    d.k = pages_of<KV>(k);
    d.v = pages_of<KV>(v);
    if (table != nullptr) {
      d.k.table = d.v.table = table;
      d.k.table_ld = d.v.table_ld = capacity / page;
    }
    d.range = range;
    d.qrange = qrange;
    d.q_total = q.size(3);
    d.bq = c.bq;
    d.nqb = (q_len + d.bq - 1) / d.bq;
    int64_t span = 0;
    for (int64_t n = 0; n < N; ++n) span = std::max(span, range[2 * n + 1] - range[2 * n]);
    divide(d, span);
    decode_impl(d, rows_of<T*>(out, out.data_ptr<T>()), lse.data_ptr<T>());
  });
  return {out, lse};
}

}  // namespace attnkit
