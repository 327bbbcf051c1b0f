// The backward's matrix-unit path: a call of bfloat16 queries, keys, values and output gradient
// on a CPU with AMX or AVX512-BF16 (matrix_unit.h) takes its five products there, on keys and
// values packed once per call (MatrixBackward) and a thread's bfloat16 rows (MatrixRowsBackward);
// visit_backward_bf16 is backward.cpp's visit_backward with those products. Compiled only where
// the instruction set allows it (ATTNKIT_MATRIX_UNIT).
#pragma once

#include "backward.h"
#include "matrix_unit.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

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

// Whether every element of a float32 tensor is a bfloat16 number (NaN: no). Only the matrix
// unit's products ask (an unused function would be a warning where they are not built).
bool bf16_numbers(const at::Tensor& x) {
  return x.numel() == 0 || x.equal(x.to(at::kBFloat16).to(at::kFloat));
}
#endif

}  // namespace
}  // namespace attnkit
