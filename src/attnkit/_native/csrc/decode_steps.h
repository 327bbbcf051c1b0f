// The decode path's step loop: a visit's keys in steps (run_visit), each step's products, terms,
// online softmax and weighted values for one key/value head (run_step) or, for token-major rows,
// for all the item's heads in address order (run_token_step); careful steps for rows that came out
// NaN or inf (weigh_seen).
#pragma once

#include "decode_call.h"
#include "decode_group.h"
#include "decode_tiles.h"
#include "position.h"
#include "scores.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

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
      for (; e < dv; ++e) {
        const T xe = element_as<T>(xr[e]);
        o[e] += p[r * nk + j] * xe + xe * T(0);
      }
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

// exp2_sum for weights that are rounded to bfloat16 next (the grouped steps on AVX512-BF16's dot
// products): exp2_fast's 2.4e-7 where a correctly rounded exp2 took three times as long.
template <typename T>
ATTNKIT_INLINE T exp2_sum_rounded(T* x, int64_t n, T m) {
#if defined(ATTNKIT_MATRIX_UNIT)
  if constexpr (std::is_same_v<T, float>) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp2_fast(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv));
      _mm512_storeu_ps(x + j, e);
      acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
      const __mmask16 tail = __mmask16((1u << (n - j)) - 1);
      const __m512 e = exp2_fast(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + j), mv));
      _mm512_mask_storeu_ps(x + j, tail, e);
      acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(tail, e));
    }
    return _mm512_reduce_add_ps(acc);
  }
#endif
  return exp2_sum(x, n, m);
}

// The online softmax of a step's scores s (rows vis[2]:vis[3] of the query block at qs, each for
// the G query heads of head (n, hk), of keys [vis[0], vis[1]), terms added): the rows' running
// maxima m and sums l, their weighted values acc rescaled to the new maxima, s made the weights
// (dropped where dropout drops). rounded: the weights are rounded to bfloat16 next (see
// exp2_sum_rounded).
template <typename T>
ATTNKIT_INLINE void softmax_step(const Call<T>& c, int64_t n, int64_t hk, int64_t qs,
                                 const int64_t* vis, T* s, T* acc, T* m, T* l,
                                 bool rounded = false) {
  const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], r1 = vis[3], G = c.G;
  for (int64_t r = 0; r < (r1 - r0) * G; ++r) {
    T* row = s + r * nk;
    const T mnew = std::max(m[r], row_max(row, nk));
    const T safe = std::isinf(mnew) && mnew < 0 ? T(0) : mnew;
    const T scale = std::exp2(m[r] - safe);
    l[r] = l[r] * scale + (rounded ? exp2_sum_rounded(row, nk, safe) : exp2_sum(row, nk, safe));
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

// Whether a step of many rows (more than kDotRows) runs on decode_group.h's products: float32
// products on keys and values of another dtype, read in blocks converted once (an AVX-512 build;
// register_tiles false keeps the GEMMs, as it keeps the blocked forward's).
template <typename T, typename KV>
ATTNKIT_INLINE bool grouped([[maybe_unused]] const Call<T>& c) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && !std::is_same_v<KV, float>) return c.register_tiles;
#endif
  return false;
}

#if defined(ATTNKIT_MATRIX_UNIT)
// Whether a grouped step of bfloat16 queries (b.q16_ok), keys and values runs on AVX512-BF16's dot
// products (decode_group.h's group_dots_bf16 and group_weigh_bf16) rather than float32 FMAs.
template <typename T, typename KV>
ATTNKIT_INLINE bool on_bf16_dots(const DecodeBuffers<T, KV>& b) {
  return b.q16_ok && bf16_dots_outrun_fma();
}
#endif

// A grouped step's products (see grouped): s (nr x nk) = alpha * rows first .. first + nr of
// head hh's queries x the keys^T (group_keys), acc += s's weights x the values (group_values).
template <typename T, typename KV>
ATTNKIT_INLINE void group_keys([[maybe_unused]] const Decode<T, KV>& d,
                               [[maybe_unused]] DecodeBuffers<T, KV>& b, [[maybe_unused]] int64_t hh,
                               [[maybe_unused]] int64_t first, [[maybe_unused]] int64_t nr,
                               [[maybe_unused]] int64_t nk, [[maybe_unused]] int64_t dk,
                               [[maybe_unused]] T alpha, [[maybe_unused]] RowList<KV> keys,
                               [[maybe_unused]] T* s, [[maybe_unused]] const Ahead<KV>& ahead) {
  const int64_t q0 = (hh * d.rows() + first) * dk;
#if defined(ATTNKIT_MATRIX_UNIT)
  if constexpr (kBf16Pairs<T, KV>) {
    if (on_bf16_dots(b)) {
      // The rows packed once for all the steps that take the same rows.
      at::BFloat16* qp = b.lanes() + hh * ((d.rows() + 15) / 16) * lane_block(dk);
      if (b.lanes_first[hh] != first || b.lanes_count[hh] != nr) {
        pack_lanes(b.q16.data() + q0, dk, nr, dk, qp);
        b.lanes_first[hh] = first;
        b.lanes_count[hh] = nr;
      }
      group_dots_bf16(nr, nk, dk, alpha, qp, keys, s, nk, ahead);
      return;
    }
  }
#endif
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && !std::is_same_v<KV, float>) {
    group_dots(nr, nk, dk, alpha, b.q.data() + q0, dk, keys, s, nk, b.wide_keys(), ahead);
  }
#endif
}

template <typename T, typename KV>
ATTNKIT_INLINE void group_values([[maybe_unused]] DecodeBuffers<T, KV>& b,
                                 [[maybe_unused]] int64_t nr, [[maybe_unused]] int64_t nk,
                                 [[maybe_unused]] int64_t dv, [[maybe_unused]] const T* s,
                                 [[maybe_unused]] RowList<KV> values, [[maybe_unused]] T* acc,
                                 [[maybe_unused]] const Ahead<KV>& ahead) {
#if defined(ATTNKIT_MATRIX_UNIT)
  if constexpr (kBf16Pairs<T, KV>) {
    if (on_bf16_dots(b)) {
      group_weigh_bf16(nr, nk, dv, s, nk, values, acc, b.w16.data(), ahead);
      return;
    }
  }
#endif
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && !std::is_same_v<KV, float>) {
    group_weigh(nr, nk, dv, s, nk, values, acc, b.wide_values(), ahead);
  }
#endif
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
  // (kQuantizedUnit: the keys as the products read them, over their values)
  const T alpha = product_factor(c) / T(kQuantizedUnit<KV>);
  const bool few = nr <= kDotRows;
  const bool group = !few && !careful && grouped<T, KV>(c);
  // Few rows (and grouped steps): the next keys are asked for during this step's key products and
  // the next values during its value products (where weigh can): asked for in one burst, the
  // lines queue behind each other and stall the products they run beside; spread over both
  // passes, the memory traffic overlaps the products of both.
  const bool split = (few && !careful && kWeighAsks<T>) || group;
  Ahead<KV> next_keys = ahead, next_values;
  if (split) {
    next_keys.v_bytes = 0;
    next_values = ahead;
    next_values.k_bytes = 0;
    // Values that lie in the keys' rows (latent attention's, the first columns of its keys): the
    // keys' asks bring them.
    const int64_t last = ahead.rows - 1;
    if (last >= 0 && ahead.v[0] == ahead.k[0] && ahead.v[last] == ahead.k[last] &&
        ahead.v_bytes <= ahead.k_bytes) {
      next_values.rows = 0;
    }
  }
  if (few) {
    key_dots(b, (hh * R + first) * c.Dk, nr, nk, c.Dk, alpha, keys, s, nk, next_keys);
  } else if (group) {
    group_keys(d, b, hh, first, nr, nk, c.Dk, alpha, keys, s, next_keys);
  } else {  // the step lies in one page (see run_visit)
    ahead.for_keys(0, nk, nk);
    int64_t ld = 0;
    const T* k = rows_in<T>(d.k, keys, n, hk, ks, nk, c.Dk, b.wide_keys(), ld);
    gemm<T>(c.register_tiles, false, true, nr, nk, c.Dk, alpha, qrows, c.Dk, k, ld, T(0), s, nk);
  }
  float* k_scales = nullptr;
  float* v_scales = nullptr;
  if constexpr (is_quantized<KV>) {
    k_scales = b.k_scales.data() + hh * kStep;
    v_scales = b.v_scales.data() + hh * kStep;
    scales_of(d.k, n, hk, ks, ks + nk, k_scales);
    scales_of(d.v, n, hk, ks, ks + nk, v_scales);
    scale_columns(s, nr, nk, nk, k_scales);
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
  bool rounded = false;  // the weights rounded to bfloat16 next
#if defined(ATTNKIT_MATRIX_UNIT)
  if constexpr (kBf16Pairs<T, KV>) rounded = group && on_bf16_dots(b);
#endif
  softmax_step(c, n, hk, qs, vis, s, acc, b.m.data() + hh * R + first, b.l.data() + hh * R + first,
               rounded);
  if constexpr (is_quantized<KV>) scale_columns(s, nr, nk, nk, v_scales);
  if (careful) {
    weigh_seen(nr, nk, c.Dv, s, b.hidden.data(), values, acc);
  } else if (few) {
    weigh<T>(nr, nk, c.Dv, s, nk, values, acc, next_values);
  } else if (group) {
    group_values(b, nr, nk, c.Dv, s, values, acc, next_values);
  } else {
    int64_t ld = 0;
    const T* v = rows_in<T>(d.v, values, n, hk, ks, nk, c.Dv, b.wide_values(), ld);
    gemm<T>(c.register_tiles, false, false, nr, c.Dv, nk, T(1), s, nk, v, ld, T(1), acc, c.Dv);
  }
}

// One step of a token-major item of few rows (vis and col0 as run_step's): the products of every
// head of the item, then each head's softmax, then every head's weighted values, each over blocks
// of kTokenBlock keys, a block read for all the heads in turn, so that the rows come in address
// order (see the top of decode.cpp). Where P tokens share a page, a block of consecutive keys would
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
  // (kQuantizedUnit: the keys as the products read them, over their values)
  const T alpha = product_factor(c) / T(kQuantizedUnit<KV>);
  for (int64_t j0 = 0; j0 < nk; j0 += kTokenBlock) {
    const int64_t nb = std::min(kTokenBlock, nk - j0);
    for (int64_t hh = 0; hh < it.heads; ++hh) {
      key_dots(b, (hh * R + first) * c.Dk, nr, nb, c.Dk, alpha,
               RowList<KV>{keys + j0, hh * d.k.x.s[1]}, s + hh * nr * nk + j0, nk, Ahead<KV>{});
    }
  }
  // Quantized keys: each head's scales in the keys' order, and the scores (in reading order)
  // times them.
  if constexpr (is_quantized<KV>) {
    for (int64_t hh = 0; hh < it.heads; ++hh) {
      float* ks = b.k_scales.data() + hh * kStep;
      scales_of(d.k, it.n, it.hk0 + hh, vis[0], vis[1], ks);
      scales_of(d.v, it.n, it.hk0 + hh, vis[0], vis[1], b.v_scales.data() + hh * kStep);
      for (int64_t r = 0; r < nr; ++r) {
        T* row = s + (hh * nr + r) * nk;
        for (int64_t j = 0; j < nk; ++j) row[j] *= ks[P > 1 ? order[j] : j];
      }
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
  // Quantized values: the weights (in reading order) times their values' scales.
  if constexpr (is_quantized<KV>) {
    for (int64_t hh = 0; hh < it.heads; ++hh) {
      const float* vs = b.v_scales.data() + hh * kStep;
      for (int64_t r = 0; r < nr; ++r) {
        T* row = s + (hh * nr + r) * nk;
        for (int64_t j = 0; j < nk; ++j) row[j] *= vs[P > 1 ? order[j] : j];
      }
    }
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
  // prefetchers (see the top of decode.cpp), rather than software prefetches a head at a time; a
  // careful step goes head by head. Quantized rows go head by head too: a token of int8 or float8
  // rows is a quarter of float32's bytes, and reading every head of it in turn took 1.5x the
  // time of one head's rows with their software prefetches.
  const bool by_token = !is_quantized<KV> && few && !careful && it.heads > 1;
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

}  // namespace
}  // namespace attnkit
