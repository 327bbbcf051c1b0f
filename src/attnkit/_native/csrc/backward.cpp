// The backward: one parallel region per call. Its items are (batch, key/value head, a stretch of
// query blocks): each recomputes its blocks' probabilities from the saved log-sum-exp and
// accumulates dq for its own rows and dk/dv for its key/value head, in place when it is the
// head's only stretch, else in its own buffer, summed after the parallel region. No two items
// write the same memory. The phases: the stretches (QueryStretches), an item's rows zeroed
// (zero_item_rows), a query block (block_backward) and its visits (visit_backward), then the
// sums of what several items or threads added to (sum_denc, sum_dbias, sum_dkdv).

#include "kernel.h"
#include "matrix_unit.h"
#include "position.h"
#include "scores.h"

namespace attnkit {
namespace {

// Rows t0:t1 of head (n, hk) of a (N, Hkv, T, D) gradient, set to 0.
template <typename T>
void zero_rows(const Rows<T*>& r, int64_t n, int64_t hk, int64_t t0, int64_t t1, int64_t d) {
  for (int64_t i = t0; i < t1; ++i) std::fill(r.at(n, hk, 0, i), r.at(n, hk, 0, i) + d, T(0));
}

// Stretches of query blocks per key/value head, enough for every thread to have work, balanced
// by visits: stretch p holds query blocks first[p] : first[p + 1] and visits keys kmin[p] :
// kmax[p] (kmax <= kmin: none).
struct QueryStretches {
  int64_t parts = 1;
  std::vector<int64_t> first, kmin, kmax;

  template <typename T>
  explicit QueryStretches(const Call<T>& c) {
    const int64_t heads = c.N * c.Hkv;
    const int64_t threads = at::get_num_threads();
    // An empty batch (no heads) still gets one stretch: it divides nothing by zero.
    parts = heads == 0
                ? 1
                : std::max<int64_t>(1, std::min<int64_t>(c.nqb, (2 * threads + heads - 1) / heads));
    first.assign(parts + 1, c.nqb);
    first[0] = 0;
    const int64_t total = c.off[c.nqb];
    int64_t p = 1;
    for (int64_t b = 0; b < c.nqb && p < parts; ++b) {
      if (c.off[b + 1] * parts >= p * total) first[p++] = b + 1;
    }
    kmin.assign(parts, c.Tk);
    kmax.assign(parts, 0);
    for (p = 0; p < parts; ++p) {
      for (int64_t vi = c.off[first[p]]; vi < c.off[first[p + 1]]; ++vi) {
        kmin[p] = std::min(kmin[p], c.visits[vi * 6]);
        kmax[p] = std::max(kmax[p], c.visits[vi * 6 + 1]);
      }
    }
  }
};

// Where the backward writes. dq, dk, dv come uninitialised (every row is written); dbias (when
// not null) has the bias's own shape, contiguous, with strides ds (0 where broadcast) from
// dbias_base; dqv (when dqv.p is not null) comes uninitialised, laid out as qv; denc (when not
// null) comes zeroed, head h's row e at h * dhs[0] + e * dhs[1].
template <typename T>
struct Grads {
  Rows<const T*> dout;
  const T* lse;
  const T* delta;
  Rows<T*> dq, dk, dv;
  T* dbias = nullptr;
  int64_t ds[5] = {0, 0, 0, 0, 0};
  int64_t dbias_numel = 0, dbias_base = 0;
  Rows<T*> dqv;
  T* denc = nullptr;
  int64_t dhs[2] = {0, 0};
};

// What the items share: the call, where to write, the stretches and the buffers that several
// items or threads add to.
template <typename T>
struct Backward {
  const Call<T>& c;
  const Grads<T>& o;
  QueryStretches st;
  bool position;      // the position term's gradients are asked for
  bool dbias_shared;  // several items add to one element of dbias (see run)
  std::vector<std::vector<T>> dk_parts, dv_parts, denc_threads, dbias_parts;
  std::mutex dbias_lock;

  Backward(const Call<T>& call, const Grads<T>& grads) : c(call), o(grads), st(call) {
    const int64_t heads = c.N * c.Hkv;
    if (st.parts > 1) {
      dk_parts.resize(heads * st.parts);
      dv_parts.resize(heads * st.parts);
    }
    // Every query block of every batch row adds to enc's gradient: each thread adds into its own.
    if (o.denc != nullptr) denc_threads.resize(at::get_num_threads());
    position = c.qv.p != nullptr && (o.dqv.p != nullptr || o.denc != nullptr);
    // A bias broadcast over the batch, the key/value heads or (with several stretches) the
    // queries has elements that several items add to: then the first thread adds into dbias,
    // every other into its own buffer of the bias's shape, summed into dbias after the parallel
    // region. Otherwise every item owns its part of dbias and adds in place.
    dbias_shared =
        o.dbias != nullptr && (c.bias_aliased || (c.N > 1 && o.ds[0] == 0) ||
                               (c.Hkv > 1 && o.ds[1] == 0) || (st.parts > 1 && o.ds[3] == 0));
  }
};

// One thread's buffers, sized by the blocks.
template <typename T>
struct BackwardBuffers {
  // The score gradient with zeros around each row (dsp, rows ldp apart) and the block's rows of
  // qv contiguous (qvc), for skewed_dqv and skewed_denc.
  static constexpr int64_t kPad = 16;
  int64_t ldp;
  std::vector<T> s, t, dp, pos, dpos, dsp, qvc, pd, dqa, own_dbias;
  KeyPanels kpanels, vpanels;
  T* denc = nullptr;  // this thread's share of enc's gradient
  T* db0 = nullptr;   // where this thread adds dbias (at its base)

  BackwardBuffers(Backward<T>& w, bool first_thread) : ldp(w.c.tile_k + 2 * kPad) {
    const Call<T>& c = w.c;
    const int64_t block = c.bq * c.tile_k;
    s.resize(block);
    t.resize(c.softcap > 0 ? block : 0);
    dp.resize(block);
    pos.resize(window_size(c));
    dpos.resize(w.position ? window_size(c) : 0);
    dsp.assign(c.ez != nullptr ? c.bq * ldp : 0, T(0));
    qvc.resize(c.ez != nullptr ? c.bq * c.Dh : 0);
    pd.resize(c.p_drop > 0 ? block : 0);
    dqa.resize(c.bq * c.Dk);
    if (w.o.denc != nullptr) {
      auto& own = w.denc_threads.at(at::get_thread_num());
      if (own.empty()) own.assign(c.Hkv * c.G * c.drows * c.Dh, T(0));
      denc = own.data();
    }
    own_dbias.resize(w.dbias_shared && !first_thread ? w.o.dbias_numel : 0);
    db0 = own_dbias.empty() ? w.o.dbias : own_dbias.data();
    if (db0 != nullptr) db0 += w.o.dbias_base;
  }
};

// Where an item adds its keys' gradients: dk and dv themselves (the head's only stretch) or the
// item's own buffers, from key k0, rows lk and lv apart.
template <typename T>
struct KeyGrads {
  T *dk = nullptr, *dv = nullptr;
  int64_t k0 = 0, lk = 0, lv = 0;
};

// The rows an item writes, set to zero where it adds to them: its head's dk and dv when it is the
// head's only stretch, its rows of dqv, and its rows of dq when it visits nothing.
template <typename T>
void zero_item_rows(Backward<T>& w, int64_t n, int64_t hk, int64_t p) {
  const Call<T>& c = w.c;
  const QueryStretches& st = w.st;
  if (st.parts == 1) {
    zero_rows(w.o.dk, n, hk, 0, c.Tk, c.Dk);
    zero_rows(w.o.dv, n, hk, 0, c.Tk, c.Dv);
  }
  const int64_t i0 = st.first[p] * c.bq, i1 = std::min(st.first[p + 1] * c.bq, c.Tq);
  for (int64_t g = 0; g < c.G && w.o.dqv.p != nullptr; ++g) {
    for (int64_t i = i0; i < i1; ++i) {
      T* row = w.o.dqv.at(n, hk * c.G + g, 0, i);
      std::fill(row, row + c.Dh, T(0));
    }
  }
  if (st.kmax[p] <= st.kmin[p]) {
    for (int64_t g = 0; g < c.G; ++g) {
      for (int64_t i = i0; i < i1; ++i) {
        std::fill(w.o.dq.at(n, hk, g, i), w.o.dq.at(n, hk, g, i) + c.Dk, T(0));
      }
    }
  }
}

template <typename T>
KeyGrads<T> key_grads(Backward<T>& w, int64_t item, int64_t n, int64_t hk, int64_t p) {
  const Call<T>& c = w.c;
  KeyGrads<T> kg;
  if (w.st.parts == 1) {
    kg.dk = w.o.dk.at(n, hk, 0, 0);
    kg.dv = w.o.dv.at(n, hk, 0, 0);
    kg.lk = w.o.dk.ld();
    kg.lv = w.o.dv.ld();
    return kg;
  }
  const int64_t keys = w.st.kmax[p] - w.st.kmin[p];
  w.dk_parts[item].assign(keys * c.Dk, T(0));
  w.dv_parts[item].assign(keys * c.Dv, T(0));
  kg.dk = w.dk_parts[item].data();
  kg.dv = w.dv_parts[item].data();
  kg.k0 = w.st.kmin[p];
  kg.lk = c.Dk;
  kg.lv = c.Dv;
  return kg;
}

// dS = P * (dP - delta) for one visit's rows in place of dP, adding it to dbias and to the
// position term's gradient (in its place in the product's gradient), then times softcap's
// factor.
template <typename T>
void score_grads(Backward<T>& w, BackwardBuffers<T>& b, int64_t n, int64_t hk, int64_t g,
                 int64_t qs, const int64_t* vis, int64_t row0, bool skew, const Window<T>& dw) {
  using V = at::vec::Vectorized<T>;
  const Call<T>& c = w.c;
  const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], nr = vis[3] - vis[2];
  const int64_t* ds = w.o.ds;
  for (int64_t r = 0; r < nr; ++r) {
    const T dl = w.o.delta[row0 + r0 + r];
    T* pr = b.s.data() + r * nk;
    T* dr = b.dp.data() + r * nk;
    for (int64_t j = 0; j < nk; ++j) dr[j] = pr[j] * (dr[j] - dl);
    if (b.db0 != nullptr) {
      T* db = b.db0 + n * ds[0] + hk * ds[1] + g * ds[2] + (qs + r0 + r) * ds[3] + ks * ds[4];
      if (ds[4] == 1) {
        int64_t j = 0;
        for (; j + V::size() <= nk; j += V::size()) {
          (V::loadu(db + j) + V::loadu(dr + j)).store(db + j);
        }
        for (; j < nk; ++j) db[j] += dr[j];
      } else {
        for (int64_t j = 0; j < nk; ++j) db[j * ds[4]] += dr[j];
      }
    }
    if (w.position && skew) {
      T* row = b.dsp.data() + r * b.ldp;
      std::fill(row, row + b.kPad, T(0));
      std::copy(dr, dr + nk, row + b.kPad);
      std::fill(row + b.kPad + nk, row + 2 * b.kPad + nk, T(0));
    } else if (w.position) {
      std::copy(dr, dr + nk, dw.at(r0 + r, ks));
    }
    if (c.softcap > 0) {
      const T* tr = b.t.data() + r * nk;
      for (int64_t j = 0; j < nk; ++j) dr[j] *= T(1) - tr[j] * tr[j];
    }
  }
}

// A visit's windows of the position term and of its gradient: the block's, or the visit's own
// (computed; its gradient's zeroed when asked for).
template <typename T>
void visit_windows(const Backward<T>& w, BackwardBuffers<T>& b, int64_t n, int64_t h, int64_t qs,
                   const int64_t* vis, bool skew, const Window<T>& whole, const Window<T>& dwhole,
                   Window<T>& win, Window<T>& dw) {
  const Call<T>& c = w.c;
  win = whole;
  dw = dwhole;
  if (c.qv.p == nullptr || whole.p != nullptr || skew) return;
  win = Window<T>(c, qs, vis[2], vis[3], vis[0], vis[1], b.pos.data());
  win.compute(c, n, h, qs);
  dw = win;
  dw.p = b.dpos.data();
  if (w.position) std::fill(b.dpos.begin(), b.dpos.begin() + (vis[3] - vis[2]) * win.width, T(0));
}

// Scores (nr rows of nk, from the call's row `row`) into probabilities, from the forward's
// log-sum-exp.
template <typename T>
void probabilities_from_lse(const Backward<T>& w, T* s, int64_t row, int64_t nr, int64_t nk) {
  for (int64_t r = 0; r < nr; ++r) {
    const T L = w.o.lse[row + r];
    const T base = (std::isinf(L) && L < 0) ? T(0) : T(L * kLog2e);
    exp2_sum(s + r * nk, nk, base);
  }
}

// The probabilities a visit's p v used (b.s): with dropout, the kept ones (into b.pd), and dP
// (b.dp) of them, by the same mask and scale.
template <typename T>
const T* dropped(const Call<T>& c, BackwardBuffers<T>& b, int64_t n, int64_t h, int64_t qs,
                 const int64_t* vis) {
  if (c.p_drop <= 0) return b.s.data();
  const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], nr = vis[3] - vis[2];
  std::copy(b.s.begin(), b.s.begin() + nr * nk, b.pd.begin());
  drop(c, n, h, qs + r0, ks, nr, nk, b.pd.data(), nk);
  for (int64_t x = 0; x < nr * nk; ++x) {
    b.dp[x] = b.s[x] > T(0) ? b.dp[x] * b.pd[x] / b.s[x] : T(0);
  }
  return b.pd.data();
}

// One visit of query head g over query block qs: its probabilities from the log-sum-exp, dP,
// dropout, dV, dS and what it adds to dbias and the position term's gradients, then dQ (into
// the block's dqa) and dK.
template <typename T>
void visit_backward(Backward<T>& w, BackwardBuffers<T>& b, const KeyGrads<T>& kg, int64_t n,
                    int64_t hk, int64_t g, int64_t qs, const int64_t* vis, bool skew,
                    const Window<T>& whole, const Window<T>& dwhole) {
  const Call<T>& c = w.c;
  const int64_t h = hk * c.G + g, row0 = ((n * c.Hkv + hk) * c.G + g) * c.Tq + qs;
  const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], nr = vis[3] - vis[2];
  Window<T> win, dw;
  visit_windows(w, b, n, h, qs, vis, skew, whole, dwhole, win, dw);
  scores(c, n, hk, g, qs, vis, b.s.data(), nk, b.t.data(), win, &b.kpanels, skew);
  probabilities_from_lse(w, b.s.data(), row0 + r0, nr, nk);
  const T* dop = w.o.dout.at(n, hk, g, qs + r0);
  // dP = dO V^T (rows x keys)
  times_keys<T>(c.register_tiles, &b.vpanels, nr, ks, vis[1], c.Dv, T(1), dop, w.o.dout.ld(),
                c.v.at(n, hk, 0, ks), c.v.ld(), b.dp.data(), nk);
  const T* pv = dropped(c, b, n, h, qs, vis);
  // dV += P^T dO
  gemm<T>(c.register_tiles, true, false, nk, c.Dv, nr, T(1), pv, nk, dop, w.o.dout.ld(), T(1),
          kg.dv + (ks - kg.k0) * kg.lv, kg.lv);
  score_grads(w, b, n, hk, g, qs, vis, row0, skew, dw);
  if (w.position && skew) {
    skew_backward(c, n, h, qs, vis, b.dsp.data() + b.kPad, b.ldp, b.qvc.data(), w.o.dqv, b.denc);
  } else if (w.position && whole.p == nullptr) {
    dw.backward(c, n, h, qs, w.o.dqv, b.denc);
  }
  // dQ += scale dS K, dK += scale dS^T Q
  gemm<T>(c.register_tiles, false, false, nr, c.Dk, nk, T(c.scale), b.dp.data(), nk,
          c.k.at(n, hk, 0, ks), c.k.ld(), T(1), b.dqa.data() + r0 * c.Dk, c.Dk);
  gemm<T>(c.register_tiles, true, false, nk, c.Dk, nr, T(c.scale), b.dp.data(), nk,
          c.q.at(n, hk, g, qs + r0), c.q.ld(), T(1), kg.dk + (ks - kg.k0) * kg.lk, kg.lk);
}

#if defined(ATTNKIT_MATRIX_UNIT)
// The backward's products on the matrix unit, for a call of bfloat16 queries, keys, values and
// output gradient (matrix_unit.h): the call's K^T and V^T packed as words (for q k^T and
// dO v^T) and k as pairs of rows (for dS k), once. dK and dV are summed transposed, dK^T += q^T dS
// and dV^T += dO^T p, so that the visits' p and dS are read as pairs of rows (no transposes of
// them): each query block's q^T and dO^T in bfloat16, and an item's dK^T and dV^T in float32,
// transposed into dk and dv when the item ends. p and dS are rounded to bfloat16 for the
// products, as torch's bfloat16 backward does; the sums are float32.
struct MatrixBackward {
  PackedRows kt, vt, kp;
};

// A thread's buffers for the matrix unit.
struct MatrixRowsBackward {
  // A block's q and dO as rows (q, dout) and transposed (qt, dot); a visit's p and dS as pairs of
  // rows (pairs, ds_pairs) and dS as rows (ds).
  std::vector<at::BFloat16> q, dout, qt, dot, pairs, ds_pairs, ds;
  std::vector<float> tr, dkt, dvt;  // a block's transposes; an item's dK^T and dV^T
  int64_t ldt = 0, rp = 0;          // dkt's and dvt's row length; qt's and dot's
};

// Rows a and b of n floats (null: zeros), times alpha and rounded to bfloat16, as n pairs at out.
ATTNKIT_BF16 inline void pair_rows(const float* a, const float* b, int64_t n, float alpha,
                                   at::BFloat16* out) {
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  const __m512 al = _mm512_set1_ps(alpha);
  int64_t e = 0;
  for (; e + 16 <= n; e += 16) {
    const __m512 x = a == nullptr ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_loadu_ps(a + e), al);
    const __m512 y = b == nullptr ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_loadu_ps(b + e), al);
    _mm512_storeu_si512(o + e, bf16_pairs(x, y));
  }
  for (; e < n; ++e) {
    const at::BFloat16 x(a == nullptr ? 0.f : a[e] * alpha), y(b == nullptr ? 0.f : b[e] * alpha);
    o[e] = uint32_t(x.x) | (uint32_t(y.x) << 16);
  }
}

// The rows r0:r1 of a visit's nr x nk floats x (row r of x: block row r0 + r) as pairs of block
// rows from ra (even; rows outside r0:r1 zeros), times alpha: kr / 2 rows of nk pairs.
inline void visit_pairs(const float* x, int64_t nk, int64_t r0, int64_t r1, int64_t ra,
                        int64_t kr, float alpha, std::vector<at::BFloat16>& out) {
  if (out.size() < size_t(kr * nk)) out.resize(size_t(kr * nk));
  for (int64_t i = 0; i < kr / 2; ++i) {
    const int64_t a = ra + 2 * i, b = a + 1;
    pair_rows(a >= r0 && a < r1 ? x + (a - r0) * nk : nullptr,
              b >= r0 && b < r1 ? x + (b - r0) * nk : nullptr, nk, alpha,
              out.data() + 2 * i * nk);
  }
}

// A visit with nothing but the products (no mask within it, bias, softcap, position term or
// dropout), fused: p = exp2(s factor - lse) row by row in place of s, then per pair of block
// rows, one pass for dS = p (dP - delta) scale, written as bfloat16 rows (for dS k) and pairs
// (for q^T dS), and p as pairs (for dO^T p).
ATTNKIT_BF16 inline void plain_visit_bf16(const Backward<float>& w, MatrixRowsBackward& mr,
                                          float* s, const float* dp, int64_t row0, int64_t r0,
                                          int64_t r1, int64_t nk, int64_t ra, int64_t kr,
                                          int64_t col, int64_t kk, float factor) {
  const Call<float>& c = w.c;
  const __m512 fv = _mm512_set1_ps(factor);
  for (int64_t r = r0; r < r1; ++r) {
    const float L = w.o.lse[row0 + r];
    const float base = (std::isinf(L) && L < 0) ? 0.f : float(L * kLog2e);
    const __m512 neg = _mm512_set1_ps(-base);
    float* row = s + (r - r0) * nk;
    int64_t j = 0;
    for (; j + 16 <= nk; j += 16) {
      _mm512_storeu_ps(row + j, exp2_fast(_mm512_fmadd_ps(_mm512_loadu_ps(row + j), fv, neg)));
    }
    for (; j < nk; ++j) row[j] = std::exp2(row[j] * factor - base);
  }
  const size_t pairs = size_t(kr * nk);
  if (mr.pairs.size() < pairs) mr.pairs.resize(pairs);
  if (mr.ds_pairs.size() < pairs) mr.ds_pairs.resize(pairs);
  const __m512 scale = _mm512_set1_ps(float(c.scale));
  const __m512 zero = _mm512_setzero_ps();
  auto ds_of = [&](int64_t r, int64_t j, __m512 p, __mmask16 m) {
    const __m512 dl = _mm512_set1_ps(w.o.delta[row0 + r]);
    const __m512 d = _mm512_maskz_loadu_ps(m, dp + (r - r0) * nk + j);
    return _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(d, dl)), scale);
  };
  for (int64_t i = 0; i < kr / 2; ++i) {
    const int64_t a = ra + 2 * i, b = a + 1;
    const bool ina = a >= r0 && a < r1, inb = b >= r0 && b < r1;
    uint32_t* pp = reinterpret_cast<uint32_t*>(mr.pairs.data() + 2 * i * nk);
    uint32_t* dsp = reinterpret_cast<uint32_t*>(mr.ds_pairs.data() + 2 * i * nk);
    at::BFloat16* dsa = ina ? mr.ds.data() + (a - r0) * kk + col : nullptr;
    at::BFloat16* dsb = inb ? mr.ds.data() + (b - r0) * kk + col : nullptr;
    for (int64_t j = 0; j < nk; j += 16) {
      const __mmask16 m = nk - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (nk - j)) - 1);
      const __m512 pa = ina ? _mm512_maskz_loadu_ps(m, s + (a - r0) * nk + j) : zero;
      const __m512 pb = inb ? _mm512_maskz_loadu_ps(m, s + (b - r0) * nk + j) : zero;
      const __m512 da = ina ? ds_of(a, j, pa, m) : zero;
      const __m512 db = inb ? ds_of(b, j, pb, m) : zero;
      _mm512_mask_storeu_epi32(pp + j, m, bf16_pairs(pa, pb));
      _mm512_mask_storeu_epi32(dsp + j, m, bf16_pairs(da, db));
      if (ina) _mm256_mask_storeu_epi16(dsa + j, m, bf16_of(da));
      if (inb) _mm256_mask_storeu_epi16(dsb + j, m, bf16_of(db));
    }
  }
}

// visit_backward with its five products on the matrix unit.
inline void visit_backward_bf16(Backward<float>& w, BackwardBuffers<float>& b,
                                const KeyGrads<float>& kg, const MatrixBackward& m,
                                MatrixRowsBackward& mr, int64_t n, int64_t hk, int64_t g,
                                int64_t qs, const int64_t* vis, bool skew,
                                const Window<float>& whole, const Window<float>& dwhole) {
  const Call<float>& c = w.c;
  const int64_t h = hk * c.G + g, row0 = ((n * c.Hkv + hk) * c.G + g) * c.Tq + qs;
  const int64_t ks = vis[0], ke = vis[1], nk = ke - ks, r0 = vis[2], r1 = vis[3], nr = r1 - r0;
  Window<float> win, dw;
  visit_windows(w, b, n, h, qs, vis, skew, whole, dwhole, win, dw);
  // The probabilities, from the forward's log-sum-exp.
  float* s = b.s.data();
  bf16_product(nr, nk, c.Dk, mr.q.data() + r0 * c.Dk, c.Dk, m.kt.head(n, hk) + ks * 2, m.kt.ld,
               s, nk, false);
  const float factor = product_factor(c);
  // Sums over the visit's rows run over whole pairs of block rows, from the pair holding r0 to
  // the one holding r1 - 1; over its keys, from the pair holding ks (outside: weighted 0).
  const int64_t ra = r0 & ~int64_t(1), kr = ((r1 + 1) & ~int64_t(1)) - ra;
  const int64_t ka = ks & ~int64_t(1), kk = ((ke + 1) & ~int64_t(1)) - ka;
  const bool plain = !vis[4] && !skew && c.softcap <= 0 && c.bias == nullptr &&
                     c.qv.p == nullptr && c.p_drop <= 0 && w.o.dbias == nullptr;
  if (plain) {
    bf16_product(nr, nk, c.Dv, mr.dout.data() + r0 * c.Dv, c.Dv, m.vt.head(n, hk) + ks * 2,
                 m.vt.ld, b.dp.data(), nk, false);
    // (dS's rows run over whole pairs of keys: their first and last may lie outside the visit)
    if (mr.ds.size() < size_t(nr * kk)) mr.ds.resize(size_t(nr * kk));
    for (int64_t r = 0; r < nr; ++r) {
      at::BFloat16* o = mr.ds.data() + r * kk;
      o[0] = o[kk - 1] = at::BFloat16(0.f);
    }
    plain_visit_bf16(w, mr, s, b.dp.data(), row0, r0, r1, nk, ra, kr, ks - ka, kk, factor);
    bf16_product(c.Dv, nk, kr, mr.dot.data() + ra, mr.rp, mr.pairs.data(), nk,
                 mr.dvt.data() + (ks - kg.k0), mr.ldt, true);
    bf16_product(nr, c.Dk, kk, mr.ds.data(), kk, m.kp.head(n, hk) + ka * c.Dk, c.Dk,
                 b.dqa.data() + r0 * c.Dk, c.Dk, true);
    bf16_product(c.Dk, nk, kr, mr.qt.data() + ra, mr.rp, mr.ds_pairs.data(), nk,
                 mr.dkt.data() + (ks - kg.k0), mr.ldt, true);
    return;
  }
  for (int64_t r = 0; r < nr; ++r) scale_row(s + r * nk, nk, factor);
  score_terms(c, n, hk, g, qs, vis, 0, s, nk, b.t.data(), win, skew);
  probabilities_from_lse(w, s, row0 + r0, nr, nk);
  // dP = dO V^T
  bf16_product(nr, nk, c.Dv, mr.dout.data() + r0 * c.Dv, c.Dv, m.vt.head(n, hk) + ks * 2,
               m.vt.ld, b.dp.data(), nk, false);
  const float* pv = dropped(c, b, n, h, qs, vis);
  // dV^T += dO^T P
  visit_pairs(pv, nk, r0, r1, ra, kr, 1.f, mr.pairs);
  bf16_product(c.Dv, nk, kr, mr.dot.data() + ra, mr.rp, mr.pairs.data(), nk,
               mr.dvt.data() + (ks - kg.k0), mr.ldt, true);
  score_grads(w, b, n, hk, g, qs, vis, row0, skew, dw);
  if (w.position && skew) {
    skew_backward(c, n, h, qs, vis, b.dsp.data() + b.kPad, b.ldp, b.qvc.data(), w.o.dqv, b.denc);
  } else if (w.position && whole.p == nullptr) {
    dw.backward(c, n, h, qs, w.o.dqv, b.denc);
  }
  // dQ += scale dS K, dK^T += scale Q^T dS
  const float scale = float(c.scale);
  if (mr.ds.size() < size_t(nr * kk)) mr.ds.resize(size_t(nr * kk));
  for (int64_t r = 0; r < nr; ++r) {
    at::BFloat16* o = mr.ds.data() + r * kk;
    o[0] = o[kk - 1] = at::BFloat16(0.f);
    float* dr = b.dp.data() + r * nk;
    scale_row(dr, nk, scale);
    row_to_bf16(dr, nk, o + (ks - ka));
  }
  bf16_product(nr, c.Dk, kk, mr.ds.data(), kk, m.kp.head(n, hk) + ka * c.Dk, c.Dk,
               b.dqa.data() + r0 * c.Dk, c.Dk, true);
  visit_pairs(b.dp.data(), nk, r0, r1, ra, kr, 1.f, mr.pairs);
  bf16_product(c.Dk, nk, kr, mr.qt.data() + ra, mr.rp, mr.pairs.data(), nk,
               mr.dkt.data() + (ks - kg.k0), mr.ldt, true);
}

// A query block's q and dO for head (n, hk, g) as bfloat16 rows, and transposed (q^T, dO^T: rp
// columns, the rows rounded up to even, the last 0 when rows is odd).
inline void block_rows_bf16(const Backward<float>& w, MatrixRowsBackward& mr, int64_t n,
                            int64_t hk, int64_t g, int64_t qs, int64_t rows) {
  const Call<float>& c = w.c;
  mr.rp = (rows + 1) & ~int64_t(1);
  auto fill = [&](const Rows<const float*>& x, int64_t d, std::vector<at::BFloat16>& flat,
                  std::vector<at::BFloat16>& t) {
    if (flat.size() < size_t(rows * d)) flat.resize(size_t(rows * d));
    if (t.size() < size_t(d * mr.rp)) t.resize(size_t(d * mr.rp));
    if (mr.tr.size() < size_t(d * mr.rp)) mr.tr.resize(size_t(d * mr.rp));
    for (int64_t r = 0; r < rows; ++r) {
      row_to_bf16(x.at(n, hk, g, qs + r), d, flat.data() + r * d);
    }
    at::vec::transpose_mxn<float>(x.at(n, hk, g, qs), x.ld(), mr.tr.data(), mr.rp, int(rows),
                                  int(d));
    for (int64_t e = 0; e < d; ++e) {
      if (rows < mr.rp) mr.tr[e * mr.rp + rows] = 0.f;
      row_to_bf16(mr.tr.data() + e * mr.rp, mr.rp, t.data() + e * mr.rp);
    }
  };
  fill(c.q, c.Dk, mr.q, mr.qt);
  fill(w.o.dout, c.Dv, mr.dout, mr.dot);
}

// An item's dK^T and dV^T: zeroed for keys [k0, k1) when it starts (start), transposed into the
// keys' gradients (kg, which only this item writes) when it ends.
inline void item_grads_bf16(const Call<float>& c, MatrixRowsBackward& mr, const KeyGrads<float>& kg,
                            int64_t k0, int64_t k1, bool start) {
  if (start) {
    mr.ldt = std::max<int64_t>(k1 - kg.k0, 1);
    mr.dkt.assign(size_t(c.Dk * mr.ldt), 0.f);
    mr.dvt.assign(size_t(c.Dv * mr.ldt), 0.f);
    return;
  }
  if (k1 <= k0) return;
  at::vec::transpose_mxn<float>(mr.dkt.data() + (k0 - kg.k0), mr.ldt, kg.dk + (k0 - kg.k0) * kg.lk,
                                kg.lk, int(c.Dk), int(k1 - k0));
  at::vec::transpose_mxn<float>(mr.dvt.data() + (k0 - kg.k0), mr.ldt, kg.dv + (k0 - kg.k0) * kg.lv,
                                kg.lv, int(c.Dv), int(k1 - k0));
}
#endif

// Query head g over query block qb: its keys packed, the position term's block window, every
// visit, then the block's rows of dq.
template <typename T>
void block_backward(Backward<T>& w, BackwardBuffers<T>& b, const KeyGrads<T>& kg, int64_t n,
                    int64_t hk, int64_t g, int64_t qb, const void* matrix, void* matrix_rows) {
  const Call<T>& c = w.c;
  const int64_t h = hk * c.G + g, qs = qb * c.bq, rows = std::min(c.bq, c.Tq - qs);
  std::fill(b.dqa.begin(), b.dqa.end(), T(0));
#if defined(ATTNKIT_MATRIX_UNIT)
  const auto* m = static_cast<const MatrixBackward*>(matrix);
  auto* mr = static_cast<MatrixRowsBackward*>(matrix_rows);
  if constexpr (std::is_same_v<T, float>) {
    if (m != nullptr) block_rows_bf16(w, *mr, n, hk, g, qs, rows);
  }
#else
  (void)matrix, (void)matrix_rows;
#endif
  if (matrix == nullptr) {
    pack_keys(c, c.k, c.Dk, n, hk, qb, rows, b.kpanels);
    pack_keys(c, c.v, c.Dv, n, hk, qb, rows, b.vpanels);
  }
  const bool skew = skew_block(c, qb);
  // The position product, and its gradient (dwhole: the same window in dpos), unless the
  // block's term and its gradients are skewed products.
  const Window<T> whole = skew ? Window<T>() : block_window(c, qb, b.pos.data());
  Window<T> dwhole = whole;
  if (whole.p != nullptr) {
    whole.compute(c, n, h, qs);
    dwhole.p = b.dpos.data();
    if (w.position) std::fill(b.dpos.begin(), b.dpos.begin() + rows * whole.width, T(0));
  }
  if (skew && w.o.denc != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = c.qv.at(n, h, 0, qs + r);
      std::copy(src, src + c.Dh, b.qvc.data() + r * c.Dh);
    }
  }
  for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
#if defined(ATTNKIT_MATRIX_UNIT)
    if constexpr (std::is_same_v<T, float>) {
      if (m != nullptr) {
        visit_backward_bf16(w, b, kg, *m, *mr, n, hk, g, qs, c.visits + vi * 6, skew, whole,
                            dwhole);
        continue;
      }
    }
#endif
    visit_backward(w, b, kg, n, hk, g, qs, c.visits + vi * 6, skew, whole, dwhole);
  }
  if (w.position && whole.p != nullptr) dwhole.backward(c, n, h, qs, w.o.dqv, b.denc);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(b.dqa.begin() + r * c.Dk, b.dqa.begin() + (r + 1) * c.Dk,
              w.o.dq.at(n, hk, g, qs + r));
  }
}

// The threads' shares of enc's gradient: their rows that are rows of enc, into denc.
template <typename T>
void sum_denc(Backward<T>& w) {
  const Call<T>& c = w.c;
  const int64_t e0 = std::max<int64_t>(0, c.dfirst), e1 = std::min(c.P, c.dfirst + c.drows);
  const int64_t per_head = std::max<int64_t>(0, e1 - e0);
  at::parallel_for(0, c.Hkv * c.G * per_head, 64, [&](int64_t begin, int64_t end) {
    for (const auto& own : w.denc_threads) {
      if (own.empty()) continue;
      for (int64_t x = begin; x < end; ++x) {
        const int64_t h = x / per_head, e = e0 + x % per_head;
        T* to = w.o.denc + h * w.o.dhs[0] + e * w.o.dhs[1];
        const T* from = own.data() + (h * c.drows + e - c.dfirst) * c.Dh;
        for (int64_t d = 0; d < c.Dh; ++d) to[d] += from[d];
      }
    }
  });
}

// The other threads' buffers of a shared dbias, into dbias.
template <typename T>
void sum_dbias(Backward<T>& w) {
  at::parallel_for(0, w.o.dbias_numel, 4096, [&](int64_t begin, int64_t end) {
    for (const auto& part : w.dbias_parts) {
      for (int64_t x = begin; x < end; ++x) w.o.dbias[x] += part[x];
    }
  });
}

// The stretches' buffers of dk and dv, into dk and dv.
template <typename T>
void sum_dkdv(Backward<T>& w) {
  const Call<T>& c = w.c;
  const QueryStretches& st = w.st;
  at::parallel_for(0, c.N * c.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / c.Hkv, hk = nh % c.Hkv;
      zero_rows(w.o.dk, n, hk, 0, c.Tk, c.Dk);
      zero_rows(w.o.dv, n, hk, 0, c.Tk, c.Dv);
      for (int64_t p = 0; p < st.parts; ++p) {
        const auto& bk = w.dk_parts[nh * st.parts + p];
        const auto& bv = w.dv_parts[nh * st.parts + p];
        if (bk.empty()) continue;
        for (int64_t j = 0; j < st.kmax[p] - st.kmin[p]; ++j) {
          T* rk = w.o.dk.at(n, hk, 0, st.kmin[p] + j);
          T* rv = w.o.dv.at(n, hk, 0, st.kmin[p] + j);
          for (int64_t d = 0; d < c.Dk; ++d) rk[d] += bk[j * c.Dk + d];
          for (int64_t d = 0; d < c.Dv; ++d) rv[d] += bv[j * c.Dv + d];
        }
      }
    }
  });
}

// matrix: a MatrixBackward when the products run on the matrix unit, else null.
template <typename T>
void backward_impl(const Call<T>& c, const Grads<T>& grads, const void* matrix) {
  Backward<T> w(c, grads);
  const int64_t items = c.N * c.Hkv * w.st.parts;
  std::atomic<int64_t> next{0};  // items are claimed one at a time (see claim)
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t) {
    OneBlasThread one;
    BackwardBuffers<T> b(w, begin == 0);
#if defined(ATTNKIT_MATRIX_UNIT)
    MatrixUnitThread unit;
    unit.used = matrix != nullptr;
    MatrixRowsBackward mr;
    void* matrix_rows = &mr;
#else
    void* matrix_rows = nullptr;
#endif
    for (int64_t item = claim(next); item < items; item = claim(next)) {
      const int64_t nh = item / w.st.parts, p = item % w.st.parts;
      const int64_t n = nh / c.Hkv, hk = nh % c.Hkv;
      zero_item_rows(w, n, hk, p);
      if (w.st.kmax[p] <= w.st.kmin[p]) continue;
      const KeyGrads<T> kg = key_grads(w, item, n, hk, p);
#if defined(ATTNKIT_MATRIX_UNIT)
      if constexpr (std::is_same_v<T, float>) {
        if (matrix != nullptr) item_grads_bf16(c, mr, kg, w.st.kmin[p], w.st.kmax[p], true);
      }
#endif
      for (int64_t g = 0; g < c.G; ++g) {
        for (int64_t qb = w.st.first[p]; qb < w.st.first[p + 1]; ++qb) {
          block_backward(w, b, kg, n, hk, g, qb, matrix, matrix_rows);
        }
      }
#if defined(ATTNKIT_MATRIX_UNIT)
      if constexpr (std::is_same_v<T, float>) {
        if (matrix != nullptr) item_grads_bf16(c, mr, kg, w.st.kmin[p], w.st.kmax[p], false);
      }
#endif
    }
    if (!b.own_dbias.empty()) {
      std::lock_guard<std::mutex> lock(w.dbias_lock);
      w.dbias_parts.push_back(std::move(b.own_dbias));
    }
  });
  if (grads.denc != nullptr) sum_denc(w);
  if (!w.dbias_parts.empty()) sum_dbias(w);
  if (w.st.parts > 1) sum_dkdv(w);
}

}  // namespace

// A (N, Hkv, T, D) tensor like k or v: token-major when it is, else contiguous. (The operators'
// fake kernels lay their outputs out the same way.)
at::Tensor like_kv(const at::Tensor& k, c10::optional<at::ScalarType> dtype) {
  const auto options = k.options().dtype(dtype.value_or(k.scalar_type()));
  const bool token_major = k.size(2) > 1 && k.stride(2) >= k.size(1) * k.size(3);
  if (!token_major) return at::empty(k.sizes(), options);
  return at::empty({k.size(0), k.size(2), k.size(1), k.size(3)}, options).permute({0, 2, 1, 3});
}

#if defined(ATTNKIT_MATRIX_UNIT)
namespace {
// Whether every element of a float32 tensor is a bfloat16 number (NaN: no). Only the matrix
// unit's products ask (an unused function would be a warning where they are not built).
bool bf16_numbers(const at::Tensor& x) {
  return x.numel() == 0 || at::equal(x, x.to(at::kBFloat16).to(at::kFloat));
}
}  // namespace
#endif

std::vector<at::Tensor> backward(const CallArgs& given, const BackwardArgs& b) {
  CallArgs a = given;
  TORCH_CHECK(a.q.dim() == 5 && a.k.dim() == 4 && a.v.dim() == 4,
              "attnkit: q must be (N, Hkv, G, Tq, Dk) and k, v (N, Hkv, Tk, D)");
  TORCH_CHECK((a.k.scalar_type() == a.q.scalar_type() ||
               (a.q.scalar_type() == at::kFloat && a.k.scalar_type() == at::kBFloat16)) &&
                  a.v.scalar_type() == a.k.scalar_type(),
              "attnkit: the backward takes q, k and v of one dtype (or float32 q with bfloat16 "
              "k and v), got ", a.q.scalar_type(), ", ", a.k.scalar_type(), " and ",
              a.v.scalar_type());
  // bfloat16 keys and values: their products on the matrix unit where the CPU has one and the
  // queries and output gradient are bfloat16 numbers too (a bfloat16 call's); the kernel
  // otherwise computes in float32 on converted copies. Their gradients come in q's dtype.
#if defined(ATTNKIT_MATRIX_UNIT)
  std::optional<MatrixBackward> matrix;
#endif
  if (a.k.scalar_type() != a.q.scalar_type()) {
    const at::Tensor k16 = a.k, v16 = a.v;
    a.k = a.k.to(a.q.scalar_type());
    a.v = a.v.to(a.q.scalar_type());
#if defined(ATTNKIT_MATRIX_UNIT)
    const auto k_rows = rows_of<const at::BFloat16*>(k16, k16.data_ptr<at::BFloat16>());
    const auto v_rows = rows_of<const at::BFloat16*>(v16, v16.data_ptr<at::BFloat16>());
    const int64_t N = a.q.size(0), Hkv = a.q.size(1), Tk = k16.size(2);
    if (a.register_tiles && a.q.size(3) > 0 && Tk > 0 && has_bf16_products() &&
        PackedRows::fits(k_rows, k16.size(3)) && PackedRows::fits(v_rows, v16.size(3)) &&
        bf16_numbers(a.q) && bf16_numbers(b.dout)) {
      matrix.emplace(MatrixBackward{PackedRows(k_rows, N, Hkv, Tk, k16.size(3), true),
                                    PackedRows(v_rows, N, Hkv, Tk, v16.size(3), true),
                                    PackedRows(k_rows, N, Hkv, Tk, k16.size(3), false)});
      PackedRows::pack_all({&matrix->kt, &matrix->vt, &matrix->kp});
    }
#endif
  }
  const at::Tensor &q = a.q, &k = a.k, &v = a.v;
  const std::vector<int64_t> rows = {q.size(0), q.size(1), q.size(2), q.size(3)};
  TORCH_CHECK(
      b.lse.sizes() == rows && b.delta.sizes() == rows && b.lse.is_contiguous() &&
          b.delta.is_contiguous() && b.lse.scalar_type() == q.scalar_type() &&
          b.delta.scalar_type() == q.scalar_type(),
      "attnkit: lse and delta must be contiguous (N, Hkv, G, Tq) tensors of q's dtype, got ",
      b.lse.sizes(), " and ", b.delta.sizes());
  TORCH_CHECK(b.dout.dim() == 5 && b.dout.size(0) == q.size(0) && b.dout.size(1) == q.size(1) &&
                  b.dout.size(2) == q.size(2) && b.dout.size(3) == q.size(3) &&
                  b.dout.size(4) == v.size(3) && b.dout.scalar_type() == q.scalar_type(),
              "attnkit: dout must be (N, Hkv, G, Tq, Dv) of q's dtype, got ", b.dout.sizes());
  // dq, dk, dv: where the caller gives them (q's, k's and v's own shapes and dtype, rows
  // contiguous), else laid out as the inputs are (token-major or contiguous), so that the
  // caller's transpose back is free. The kernel writes every element.
  at::Tensor dq = b.dq, dk = b.dk, dv = b.dv;
  if (!dq.defined()) {
    dq = like_q(q, q.size(4));
    dk = like_kv(k);
    dv = like_kv(v);
  } else {
    const at::Tensor* given[3] = {&dq, &dk, &dv};
    const at::Tensor* like[3] = {&q, &k, &v};
    for (int x = 0; x < 3; ++x) {
      TORCH_CHECK(given[x]->defined() && given[x]->sizes() == like[x]->sizes() &&
                      given[x]->scalar_type() == like[x]->scalar_type() &&
                      (given[x]->stride(-1) == 1 || given[x]->size(-1) <= 1),
                  "attnkit: dq, dk and dv must have q's, k's and v's shapes and dtype, with "
                  "contiguous rows");
    }
  }
  at::Tensor dbias;
  int64_t ds[5] = {0, 0, 0, 0, 0};
  int64_t dbias_base = 0;
  if (b.bias_grad) {
    TORCH_CHECK(a.bias.has_value(), "attnkit: bias_grad without a bias");
    dbias = at::zeros(a.bias->sizes(), q.options());  // the bias's shape, not the scores'
    if (a.bias_layout.empty()) {
      TORCH_CHECK(dbias.dim() == 5, "attnkit: a dense bias is 5-d");
      for (int d = 0; d < 5; ++d) ds[d] = dbias.size(d) == 1 ? 0 : dbias.stride(d);
    } else {
      TORCH_CHECK(a.bias_layout.size() == 6, "attnkit: a bias layout is 5 strides and a base");
      for (int d = 0; d < 5; ++d) ds[d] = a.bias_layout[d];
      dbias_base = a.bias_layout[5];
    }
  }
  const bool position = a.qv.has_value() && a.enc.has_value();
  at::Tensor dqv, denc;
  // dqv laid out as qv (token-major or contiguous; every row is written), denc as enc, so that
  // the caller's transposes back are free.
  if (position && b.qv_grad) dqv = like_kv(*a.qv);
  if (position && b.enc_grad) denc = at::zeros_like(*a.enc);  // enc's layout where it is dense
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnkit::native_backward", [&] {
    using T = scalar_t;
    Call<T> c = make_call<T>(a);
    const auto tables = skew_table(c, a.enc);  // kept alive while the kernel reads them
    Grads<T> g;
    g.dout = rows_of<const T*>(b.dout, b.dout.data_ptr<T>());
    g.lse = b.lse.data_ptr<T>();
    g.delta = b.delta.data_ptr<T>();
    g.dq = rows_of<T*>(dq, dq.data_ptr<T>());
    g.dk = rows_of<T*>(dk, dk.data_ptr<T>());
    g.dv = rows_of<T*>(dv, dv.data_ptr<T>());
    if (b.bias_grad) {
      g.dbias = dbias.data_ptr<T>();
      std::copy(ds, ds + 5, g.ds);
      g.dbias_numel = dbias.numel();
      g.dbias_base = dbias_base;
    }
    if (dqv.defined()) g.dqv = rows_of<T*>(dqv, dqv.data_ptr<T>());
    if (denc.defined()) {
      g.denc = denc.data_ptr<T>();
      g.dhs[0] = denc.stride(0);
      g.dhs[1] = denc.stride(1);
    }
    const void* m = nullptr;
#if defined(ATTNKIT_MATRIX_UNIT)
    if (matrix) m = &*matrix;
#endif
    backward_impl<T>(c, g, m);
  });
  // Gradients not asked for are undefined (the operators return them as empty tensors).
  return {dq, dk, dv, dbias, dqv, denc};
}

}  // namespace attnkit
