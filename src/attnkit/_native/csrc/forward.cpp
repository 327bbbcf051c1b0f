// The forward: its items are (batch, key/value head, query block), shared by threads (share.h),
// claimed in the plan's order (see Call::item_of); each runs every visit of its query block's row
// of the plan, for each of the G query heads that share the key/value head, with thread-local
// buffers: the visit's scores (scores.h), the online softmax's running maximum and sum, and a GEMM
// for the weighted values. A row that sees no key has log-sum-exp -inf and output 0. bfloat16
// queries, keys and values on a CPU with a matrix unit take both products there instead
// (forward_head_bf16, matrix_unit.h).

#include "kernel.h"
#include "matrix_unit.h"
#include "position.h"
#include "scores.h"
#include "share.h"

namespace attnkit {
namespace {

// One thread's buffers, sized by the blocks.
template <typename T>
struct ForwardBuffers {
  std::vector<T> s, pos, acc, m, l;
  KeyPanels panels;
  explicit ForwardBuffers(const Call<T>& c)
      : s(c.bq * c.tile_k), pos(window_size(c)), acc(c.bq * c.Dv), m(c.bq), l(c.bq) {}
};

// The online softmax over one visit's scores (rows r0 .. r0 + nr - 1 of the block, in place:
// exp2 of the scores less the row's running maximum), rescaling the rows' accumulated outputs
// when their maximum grows. bounded: the scores are known to be small (see forward_impl), the
// maximum is taken as 0.
template <typename T>
void online_softmax(const Call<T>& c, ForwardBuffers<T>& b, int64_t r0, int64_t nr, int64_t nk,
                    bool bounded) {
  for (int64_t r = 0; r < nr; ++r) {
    T* row = b.s.data() + r * nk;
    const int64_t R = r0 + r;
    if (bounded) {
      b.l[R] += exp2_sum(row, nk, T(0));
      b.m[R] = T(0);
      continue;
    }
    const T mnew = std::max(b.m[R], row_max(row, nk));
    const T safe = std::isinf(mnew) && mnew < 0 ? T(0) : mnew;
    const T alpha = std::exp2(b.m[R] - safe);
    b.l[R] = b.l[R] * alpha + exp2_sum(row, nk, safe);
    if (alpha != T(1)) scale_row(b.acc.data() + R * c.Dv, c.Dv, alpha);
    b.m[R] = mnew;
  }
}

// The block's rows of lse, and of out through put(r, inv, seen) from the accumulated outputs
// and sums (inv: 1 / the row's sum; a row that sees no key, seen false, has output 0).
template <typename T, typename Put>
void finish_rows(const Call<T>& c, const ForwardBuffers<T>& b, int64_t n, int64_t hk, int64_t g,
                 int64_t qs, int64_t rows, T* lse, Put&& put) {
  const int64_t row0 = ((n * c.Hkv + hk) * c.G + g) * c.Tq + qs;
  for (int64_t r = 0; r < rows; ++r) {
    // A NaN sum (a NaN or +inf score the row sees) makes the row NaN, as in the reference; only
    // a row that sees no key gets zeros.
    if (b.l[r] > T(0) || std::isnan(b.l[r])) {
      put(r, T(1) / b.l[r], true);
      lse[row0 + r] = T((b.m[r] + std::log2(b.l[r])) * kLn2);
    } else {
      put(r, T(0), false);
      lse[row0 + r] = -std::numeric_limits<T>::infinity();
    }
  }
}

// finish_rows into out, of q's dtype.
template <typename T>
void finish_rows(const Call<T>& c, const ForwardBuffers<T>& b, int64_t n, int64_t hk, int64_t g,
                 int64_t qs, int64_t rows, const Rows<T*>& out, T* lse) {
  finish_rows(c, b, n, hk, g, qs, rows, lse, [&](int64_t r, T inv, bool seen) {
    T* o = out.at(n, hk, g, qs + r);
    const T* acc = b.acc.data() + r * c.Dv;
    for (int64_t d = 0; d < c.Dv; ++d) o[d] = seen ? acc[d] * inv : T(0);
  });
}

// Keys and values of another dtype than T (bfloat16 or float16 with float32): each visit's keys
// and values, converted into T just before its products read them (a few dozen rows, which stay
// in L1/L2 for both products), where the products read c's own keys and values (see Rows::i0).
template <typename T, typename KV>
struct Widened {
  Rows<const KV*> k, v;  // the call's keys and values
  std::vector<T> kbuf, vbuf;

  // c's keys and values [ks, ke) of head (n, hk), converted.
  void visit(Call<T>& c, int64_t n, int64_t hk, int64_t ks, int64_t ke) {
    c.k = into(k, kbuf, c.Dk, n, hk, ks, ke);
    c.v = into(v, vbuf, c.Dv, n, hk, ks, ke);
  }

  static Rows<const T*> into(const Rows<const KV*>& x, std::vector<T>& buf, int64_t width,
                             int64_t n, int64_t hk, int64_t k0, int64_t k1) {
    if (buf.size() < size_t((k1 - k0) * width)) buf.resize(size_t((k1 - k0) * width));
    for (int64_t j = k0; j < k1; ++j) {
      convert_row(x.at(n, hk, 0, j), width, buf.data() + (j - k0) * width);
    }
    Rows<const T*> r;
    r.p = buf.data();
    r.s[3] = width;
    r.i0 = k0;
    return r;
  }
};

// The start of head h over the query block from qs: its rows' sums cleared, and the position
// term's window over the whole block computed (none when it goes visit by visit or is skewed).
template <typename T>
Window<T> start_head(const Call<T>& c, ForwardBuffers<T>& b, int64_t n, int64_t h, int64_t qb,
                     int64_t qs, bool skew) {
  std::fill(b.acc.begin(), b.acc.end(), T(0));
  std::fill(b.m.begin(), b.m.end(), -std::numeric_limits<T>::infinity());
  std::fill(b.l.begin(), b.l.end(), T(0));
  const Window<T> whole = skew ? Window<T>() : block_window(c, qb, b.pos.data());
  if (whole.p != nullptr) whole.compute(c, n, h, qs);
  return whole;
}

// A visit's window of the position term: the block's, or the visit's own, computed.
template <typename T>
Window<T> visit_window(const Call<T>& c, ForwardBuffers<T>& b, const Window<T>& whole,
                       int64_t n, int64_t h, int64_t qs, const int64_t* vis, bool skew) {
  if (c.qv.p == nullptr || whole.p != nullptr || skew) return whole;
  Window<T> w(c, qs, vis[2], vis[3], vis[0], vis[1], b.pos.data());
  w.compute(c, n, h, qs);
  return w;
}

// Query head g of key/value head (n, hk) over query block qb: every visit, then its rows.
template <typename T, typename KV>
void forward_head(Call<T> c, ForwardBuffers<T>& b, Widened<T, KV>& wide, int64_t n, int64_t hk,
                  int64_t g, int64_t qb, bool skew, bool bounded, const Rows<T*>& out, T* lse) {
  const int64_t qs = qb * c.bq, rows = std::min(c.bq, c.Tq - qs), h = hk * c.G + g;
  const Window<T> whole = start_head(c, b, n, h, qb, qs, skew);
  for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
    const int64_t* vis = c.visits + vi * 6;
    const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], nr = vis[3] - vis[2];
    const Window<T> w = visit_window(c, b, whole, n, h, qs, vis, skew);
    if constexpr (!std::is_same_v<T, KV>) wide.visit(c, n, hk, ks, vis[1]);
    scores(c, n, hk, g, qs, vis, b.s.data(), nk, static_cast<T*>(nullptr), w, &b.panels, skew);
    online_softmax(c, b, r0, nr, nk, bounded);
    if (c.p_drop > 0) drop(c, n, h, qs + r0, ks, nr, nk, b.s.data(), nk);
    gemm<T>(c.register_tiles, false, false, nr, c.Dv, nk, T(1), b.s.data(), nk,
            c.v.at(n, hk, 0, ks), c.v.ld(), T(1), b.acc.data() + r0 * c.Dv, c.Dv);
  }
  finish_rows(c, b, n, hk, g, qs, rows, out, lse);
}

#if defined(ATTNKIT_MATRIX_UNIT)
// Whether a call's bfloat16 keys (rows k) and values take both products as bfloat16, on the
// matrix unit or AVX512-BF16 (matrix_unit.h). (Values of width 0 have no product to run: the
// GEMM refuses an empty one.)
inline bool matrix_unit_serves(const Call<float>& c, const Rows<const at::BFloat16*>& k) {
  return c.register_tiles && c.Tq > 0 && c.Tk > 0 && c.Dv > 0 && has_bf16_products() &&
         PackedRows::fits(k, c.Dk);
}

// A thread's rows for the matrix unit: its query block's queries and a visit's probabilities in
// bfloat16, the visit's rows' maxima and rescaling factors, the tiles' scores.
struct MatrixRows {
  std::vector<at::BFloat16> q, p;
  std::vector<float> top, s;  // s: the tiles' scores
};

// The online softmax of a visit whose scores are factor * s (s: nr rows of nk raw products, the
// block's rows r0 .. r0 + nr - 1, queries from i0), fused: one pass for the rows' maxima, then
// the rescaling of the rows whose maximum grew (16 rows' factors at a time), then one pass for
// exp2, the sums and the probabilities, written in bfloat16 to p (rows pld apart) for p v. With
// `banded`, each row sees only the keys the call's band gives it (see band_run), the others'
// probabilities 0. Rows of s ls apart; `top`: room for 2 nr + 16 floats.
ATTNKIT_BF16 inline void probabilities_bf16(const Call<float>& c, ForwardBuffers<float>& b,
                                            int64_t i0, int64_t r0, int64_t nr, int64_t ks,
                                            int64_t nk, bool banded, const float* s, int64_t ls,
                                            float factor, at::BFloat16* p, int64_t pld,
                                            float* top) {
  const __m512 fv = _mm512_set1_ps(factor);
  const bool positive = factor > 0;  // then the largest score is factor times the largest product
  const float inf = std::numeric_limits<float>::infinity();
  auto run = [&](int64_t r, int64_t& j0, int64_t& j1) {
    j0 = 0;
    j1 = nk;
    if (banded) band_run(c, i0 + r, ks, nk, j0, j1);
  };
  // The rows' largest scores, each over four running maxima (a max waits for the one before).
  for (int64_t r = 0; r < nr; ++r) {
    const float* row = s + r * ls;
    auto load = [&](int64_t j, __mmask16 m) {
      const __m512 x = _mm512_maskz_loadu_ps(m, row + j);
      return positive ? x : _mm512_mul_ps(x, fv);
    };
    int64_t j0, j1;
    run(r, j0, j1);
    __m512 mx[4];
    for (auto& x : mx) x = _mm512_set1_ps(-inf);
    int64_t j = j0;
    for (; j + 64 <= j1; j += 64) {
      for (int u = 0; u < 4; ++u) mx[u] = _mm512_max_ps(mx[u], load(j + 16 * u, 0xffff));
    }
    for (; j < j1; j += 16) {
      const __mmask16 m = j1 - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (j1 - j)) - 1);
      mx[0] = _mm512_mask_max_ps(mx[0], m, mx[0], load(j, m));
    }
    const float t = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(mx[0], mx[1]),
                                                       _mm512_max_ps(mx[2], mx[3])));
    top[r] = positive ? t * factor : t;
  }
  // The new maxima (top[r] after them: the row's exponent offset, 0 for a row that has seen no
  // key yet) and the rescaling factors (in alpha). A NaN product keeps the old maximum, as
  // std::max does, and makes the row NaN through its sum.
  float* alpha = top + nr;
  for (int64_t r = 0; r < nr; r += 16) {
    const __mmask16 m = nr - r >= 16 ? __mmask16(0xffff) : __mmask16((1u << (nr - r)) - 1);
    const __m512 old = _mm512_maskz_loadu_ps(m, b.m.data() + r0 + r);
    const __m512 mnew = _mm512_max_ps(_mm512_maskz_loadu_ps(m, top + r), old);
    const __mmask16 none = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-inf), _CMP_EQ_OQ);
    const __m512 safe = _mm512_mask_mov_ps(mnew, none, _mm512_setzero_ps());
    const __mmask16 same = _mm512_cmp_ps_mask(old, mnew, _CMP_EQ_OQ);
    const __m512 a = _mm512_mask_mov_ps(exp2_fast(_mm512_sub_ps(old, safe)), same,
                                        _mm512_set1_ps(1.f));
    _mm512_mask_storeu_ps(b.m.data() + r0 + r, m, mnew);
    _mm512_mask_storeu_ps(top + r, m, safe);
    _mm512_mask_storeu_ps(alpha + r, m, a);
  }
  for (int64_t r = 0; r < nr; ++r) {
    const float* row = s + r * ls;
    const int64_t R = r0 + r;
    if (alpha[r] != 1.f) {
      scale_row(b.acc.data() + R * c.Dv, c.Dv, alpha[r]);
      b.l[R] *= alpha[r];
    }
    int64_t j0, j1;
    run(r, j0, j1);
    at::BFloat16* out = p + r * pld;
    std::fill(out, out + j0, at::BFloat16(0.f));
    std::fill(out + j1, out + nk, at::BFloat16(0.f));
    const __m512 neg = _mm512_set1_ps(-top[r]);
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    auto prob = [&](int64_t j, __mmask16 m) {
      return exp2_fast(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, row + j), fv, neg));
    };
    int64_t j = j0;
    for (; j + 32 <= j1; j += 32) {
      const __m512 e0 = prob(j, 0xffff), e1 = prob(j + 16, 0xffff);
      sum[0] = _mm512_add_ps(sum[0], e0);
      sum[1] = _mm512_add_ps(sum[1], e1);
      _mm512_storeu_si512(out + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    for (; j < j1; j += 16) {
      const __mmask16 m = j1 - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (j1 - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(m, prob(j, m));
      sum[0] = _mm512_add_ps(sum[0], e);
      _mm256_mask_storeu_epi16(out + j, m, bf16_of(e));
    }
    b.l[R] += _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
  }
}

// forward_head with both products on the matrix unit, reading the call's packed keys and values:
// false, having done nothing, when the block's queries are not all bfloat16 values (float32
// queries with bfloat16 keys), which then take forward_head. Products summed in float32, the
// probabilities rounded to bfloat16 for p v, as torch's bfloat16 attention does. bfloat16
// queries (c.q16) are read as they are, and the output written in bfloat16 to out16. `tiles`:
// the products in the tiles directly (tile_scores, tile_values), else through torch's GEMM.
inline bool forward_head_bf16(const Call<float>& c, ForwardBuffers<float>& b,
                              const PackedRows& kt, const PackedRows& vp, MatrixRows& mr,
                              int64_t n, int64_t hk, int64_t g, int64_t qb, bool skew,
                              bool bounded, bool tiles, const Rows<float*>& out,
                              const Rows<at::BFloat16*>& out16, float* lse) {
  const int64_t qs = qb * c.bq, rows = std::min(c.bq, c.Tq - qs), h = hk * c.G + g;
  // The block's queries in bfloat16: c.q16's rows as they are, or a copy (float32 queries, or
  // the tiles, which read 32 rows of zeros past the block's).
  const at::BFloat16* q = nullptr;
  int64_t lq = c.Dk;
  if (c.q16.p != nullptr && !tiles) {
    q = c.q16.at(n, hk, g, qs);
    lq = c.q16.ld();
  } else {
    const size_t room = size_t((rows + 32) * c.Dk);
    if (mr.q.size() < room) mr.q.resize(room);
    for (int64_t r = 0; r < rows; ++r) {
      at::BFloat16* to = mr.q.data() + r * c.Dk;
      if (c.q16.p != nullptr) {
        std::copy_n(c.q16.at(n, hk, g, qs + r), c.Dk, to);
      } else if (!to_bf16_exact(c.q.at(n, hk, g, qs + r), c.Dk, to)) {
        return false;
      }
    }
    std::fill(mr.q.data() + rows * c.Dk, mr.q.data() + room, at::BFloat16(0.f));
    q = mr.q.data();
  }
  std::optional<OwnTiles> own;
  if (tiles) {
    own.emplace();
    // (the sums of 32 rows past the block's: rows the zeros of p leave as they are)
    if (b.acc.size() < size_t((c.bq + 32) * c.Dv)) b.acc.resize(size_t((c.bq + 32) * c.Dv));
  }
  const Window<float> whole = start_head(c, b, n, h, qb, qs, skew);
  const float factor = product_factor(c);
  for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
    const int64_t* vis = c.visits + vi * 6;
    const int64_t ks = vis[0], ke = vis[1], nk = ke - ks, r0 = vis[2], nr = vis[3] - vis[2];
    const Window<float> w = visit_window(c, b, whole, n, h, qs, vis, skew);
    // p v over whole pairs of keys: from the pair holding key ks (its first key weighted 0 when
    // ks is odd) to the pair holding key ke - 1 (its second weighted 0 when ke is odd); the
    // tiles take 32 keys at a time, the ones past the visit's weighted 0 too.
    const int64_t ka = ks & ~int64_t(1), kk = ((ke + 1) & ~int64_t(1)) - ka;
    const int64_t kp = tiles ? (kk + 31) / 32 * 32 : kk, nr32 = tiles ? (nr + 31) / 32 * 32 : nr;
    float* s = b.s.data();
    int64_t ls = nk;  // the scores' row length
    if (tiles) {
      ls = (nk + 31) / 32 * 32;
      if (mr.s.size() < size_t(nr32 * ls)) mr.s.resize(size_t(nr32 * ls));
      s = mr.s.data();
      tile_scores(q + r0 * lq, lq, nr, kt.head(n, hk) + ks * 2, kt.ld, nk, c.Dk, s, ls);
    } else {
      bf16_product(nr, nk, c.Dk, q + r0 * lq, lq, kt.head(n, hk) + ks * 2, kt.ld, s, nk, false);
    }
    if (mr.p.size() < size_t(nr32 * kp)) mr.p.resize(size_t(nr32 * kp));
    for (int64_t r = 0; r < nr; ++r) {
      at::BFloat16* pr = mr.p.data() + r * kp;
      pr[0] = at::BFloat16(0.f);
      std::fill(pr + (ks - ka) + nk, pr + kp, at::BFloat16(0.f));
    }
    std::fill(mr.p.data() + nr * kp, mr.p.data() + nr32 * kp, at::BFloat16(0.f));
    // Scores with nothing but the product (and a band, the mask of a partial visit) go
    // straight to probabilities; the rest take the float32 path's steps, in place, first.
    const bool banded = vis[4] && c.band_alone();
    const bool plain = (!vis[4] || banded) && !skew && c.softcap <= 0 && c.bias == nullptr &&
                       c.qv.p == nullptr && c.p_drop <= 0;
    if (plain) {
      if (mr.top.size() < size_t(2 * nr + 16)) mr.top.resize(size_t(2 * nr + 16));
      probabilities_bf16(c, b, qs + r0, r0, nr, ks, nk, banded, s, ls, factor,
                         mr.p.data() + (ks - ka), kp, mr.top.data());
    } else {
      if (s != b.s.data()) {  // the float32 path's steps read rows of nk from b.s
        for (int64_t r = 0; r < nr; ++r) std::copy_n(s + r * ls, nk, b.s.data() + r * nk);
        s = b.s.data();
      }
      for (int64_t r = 0; r < nr; ++r) scale_row(s + r * nk, nk, factor);
      score_terms(c, n, hk, g, qs, vis, 0, s, nk, static_cast<float*>(nullptr), w, skew);
      online_softmax(c, b, r0, nr, nk, bounded);
      if (c.p_drop > 0) drop(c, n, h, qs + r0, ks, nr, nk, s, nk);
      for (int64_t r = 0; r < nr; ++r) {
        row_to_bf16(s + r * nk, nk, mr.p.data() + r * kp + (ks - ka));
      }
    }
    if (tiles) {
      tile_values(mr.p.data(), kp, nr, vp.head(n, hk) + ka * c.Dv, c.Dv, b.acc.data() + r0 * c.Dv);
    } else {
      bf16_product(nr, c.Dv, kk, mr.p.data(), kk, vp.head(n, hk) + ka * c.Dv, c.Dv,
                   b.acc.data() + r0 * c.Dv, c.Dv, true);
    }
  }
  if (out16.p == nullptr) {
    finish_rows(c, b, n, hk, g, qs, rows, out, lse);
    return true;
  }
  finish_rows(c, b, n, hk, g, qs, rows, lse, [&](int64_t r, float inv, bool seen) {
    float* acc = b.acc.data() + r * c.Dv;  // (the block's last use of it)
    for (int64_t d = 0; d < c.Dv; ++d) acc[d] = seen ? acc[d] * inv : 0.f;
    row_to_bf16(acc, c.Dv, out16.at(n, hk, g, qs + r));
  });
  return true;
}
#endif

// The whole forward, into out (or, for bfloat16 queries, out16) and lse.
template <typename T, typename KV>
void forward_impl(const Call<T>& c, const Widened<T, KV>& kv, const Rows<T*>& out, T* lse,
                  [[maybe_unused]] const Rows<at::BFloat16*>& out16 = {}) {
  const int64_t items = c.N * c.Hkv * c.nqb;
  // Capped scores with nothing added lie in [-cap, cap] log2(e): with a cap of at most 69 their
  // exp2 are normal numbers whose sum over 2^20 keys stays finite, so the softmax needs no
  // running maximum (and no rescaling of the accumulated rows): it is taken as 0. A bias or a
  // position term would unbound them.
  const bool bounded = c.softcap > 0 && c.softcap * kLog2e <= 100.0 && c.bias == nullptr &&
                       c.qv.p == nullptr && c.Tk <= (int64_t(1) << 20);
  // bfloat16 keys and values on a CPU with a matrix unit: both products there, from keys and
  // values packed once for the whole call (matrix_unit.h). register_tiles false keeps every
  // product in float32.
#if defined(ATTNKIT_MATRIX_UNIT)
  std::optional<PackedRows> kt, vp;  // K^T as words, v as pairs
  bool tiles = false;                // the products in the tiles directly
  if constexpr (std::is_same_v<T, float> && std::is_same_v<KV, at::BFloat16>) {
    if (matrix_unit_serves(c, kv.k)) {
      kt.emplace(kv.k, c.N, c.Hkv, c.Tk, c.Dk, true);
      vp.emplace(kv.v, c.N, c.Hkv, c.Tk, c.Dv, false);
      PackedRows::pack_all({&*kt, &*vp});
      tiles = c.Dk % 32 == 0 && c.Dv % 32 == 0 && tiles_ready();
    }
  }
#endif
  std::atomic<int64_t> next{0};  // items are claimed one at a time (see claim)
  auto body = [&] {
    int64_t item = claim(next);
    if (item >= items) return;  // a helper that came late
    OneBlasThread one;
    ForwardBuffers<T> b(c);
    Widened<T, KV> wide = kv;
#if defined(ATTNKIT_MATRIX_UNIT)
    MatrixUnitThread unit;
    MatrixRows mr;
#endif
    for (; item < items; item = claim(next)) {
      int64_t n, hk, qb;
      c.item_of(item, n, hk, qb);
      const int64_t rows = std::min(c.bq, c.Tq - qb * c.bq);
      // (Keys converted visit by visit are not packed into panels: their products take the GEMM.)
      if constexpr (std::is_same_v<T, KV>) pack_keys(c, c.k, c.Dk, n, hk, qb, rows, b.panels);
      const bool skew = skew_block(c, qb);
      for (int64_t g = 0; g < c.G; ++g) {
#if defined(ATTNKIT_MATRIX_UNIT)
        if constexpr (std::is_same_v<T, float>) {
          if (kt && forward_head_bf16(c, b, *kt, *vp, mr, n, hk, g, qb, skew, bounded, tiles,
                                      out, out16, lse)) {
            unit.used = true;
            continue;
          }
        }
#endif
        forward_head(c, b, wide, n, hk, g, qb, skew, bounded, out, lse);
      }
    }
  };
  share(std::min<int64_t>(at::get_num_threads(), items) - 1, body);
}

}  // namespace

// A (N, Hkv, G, T, d) tensor laid out like q: (N, T, Hkv, G, d) in memory when q's rows are
// token-major (a view of (B, T, H, D), as projections give), so that the caller's transpose back
// is free; else contiguous. (The operators' fake kernels lay their outputs out the same way.)
at::Tensor like_q(const at::Tensor& q, int64_t d) {
  const bool token_major = q.size(3) > 1 && q.stride(3) >= q.size(1) * q.size(2) * q.size(4);
  if (!token_major) return empty({q.size(0), q.size(1), q.size(2), q.size(3), d}, q.options());
  return empty({q.size(0), q.size(3), q.size(1), q.size(2), d}, q.options())
      .permute({0, 2, 3, 1, 4});
}

std::tuple<at::Tensor, at::Tensor> forward(const CallArgs& a) {
  TORCH_CHECK(a.q.dim() == 5 && a.v.dim() == 4,
              "attnkit: q must be (N, Hkv, G, Tq, Dk) and v (N, Hkv, Tk, Dv), got ", a.q.sizes(),
              " and ", a.v.sizes());
  if (a.q.scalar_type() == at::kBFloat16) {
    // bfloat16 queries (with bfloat16 keys and values, see native_forward): read as they are
    // where the bfloat16 products serve the call, else converted to float32 and the output back.
#if defined(ATTNKIT_MATRIX_UNIT)
    Call<float> c = make_call<float>(a);
    Widened<float, at::BFloat16> wide;
    wide.k = rows_of<const at::BFloat16*>(a.k, a.k.data_ptr<at::BFloat16>());
    wide.v = rows_of<const at::BFloat16*>(a.v, a.v.data_ptr<at::BFloat16>());
    if (matrix_unit_serves(c, wide.k)) {
      at::Tensor out = like_q(a.q, a.v.size(3));
      at::Tensor lse = empty({a.q.size(0), a.q.size(1), a.q.size(2), a.q.size(3)},
                                 a.q.options().dtype(at::kFloat));
      const auto tables = skew_table(c, a.enc);  // kept alive while the kernel reads them
      forward_impl(c, wide, Rows<float*>(), lse.data_ptr<float>(),
                   rows_of<at::BFloat16*>(out, out.data_ptr<at::BFloat16>()));
      return {out, lse};
    }
#endif
    CallArgs f = a;
    f.q = a.q.to(at::kFloat);
    auto [out, lse] = forward(f);
    return {out.to(at::kBFloat16), lse};
  }
  at::Tensor out = like_q(a.q, a.v.size(3));
  at::Tensor lse = empty({a.q.size(0), a.q.size(1), a.q.size(2), a.q.size(3)}, a.q.options());
  with_kv_types(a.q, a.k, "attnkit::native_forward", [&](auto t, auto kv) {
    using T = decltype(t);
    using KV = decltype(kv);
    Call<T> c = make_call<T>(a);
    const auto tables = skew_table(c, a.enc);  // kept alive while the kernel reads them
    Widened<T, KV> wide;
    if constexpr (!std::is_same_v<T, KV>) {
      wide.k = rows_of<const KV*>(a.k, a.k.data_ptr<KV>());
      wide.v = rows_of<const KV*>(a.v, a.v.data_ptr<KV>());
    }
    forward_impl(c, wide, rows_of<T*>(out, out.data_ptr<T>()), lse.data_ptr<T>());
  });
  return {out, lse};
}

}  // namespace attnkit
