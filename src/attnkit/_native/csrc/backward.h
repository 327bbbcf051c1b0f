// The backward's shared parts, which its generic path (backward.cpp) and its matrix-unit path
// (backward_matrix_unit.h) both read: the stretches of query blocks (QueryStretches), where it
// writes (Grads), what its items share (Backward), a thread's buffers (BackwardBuffers), an item's
// rows zeroed and its keys' gradients (zero_item_rows, key_grads), and the steps of a visit that
// both paths take (the position term's windows, probabilities from the log-sum-exp, dropout, dS).
#pragma once

#include "plan.h"
#include "position.h"
#include "scores.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
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

}  // namespace
}  // namespace attnkit
