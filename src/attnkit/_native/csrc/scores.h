// A visit's scores (q k^T, softcap, the position term, bias, mask), dropout, and the softmax's
// row operations on them.
#pragma once

#include "plan.h"
#include "position.h"
#include "tiles.h"

namespace attnkit {
// Internal linkage, as in one translation unit: each .cpp gets its own copy of these helpers,
// which the compiler then inlines and specialises freely (their hot loops depend on it).
namespace {

// scale * tanh of a vector, exact to the dtype's rounding (float32: relative error below 5e-7,
// also near 0, where an exp-based formula would cancel) and far cheaper than a vector tanh.
// float32: y P(y^2) / Q(y^2) on |y| <= 9, a rational fit of relative error 6e-8 (beyond 9, tanh
// is +-1 in float32); ends at +-1 for +-inf, NaN stays NaN. float64: 1 - 2 / (exp(2y) + 1), with
// the series y - y^3/3 + 2y^5/15 - 17y^7/315 below |y| = 1/64, where it is exact to rounding.
template <typename T>
at::vec::Vectorized<T> tanh_of(const at::vec::Vectorized<T>& y, T scale = T(1)) {
  using V = at::vec::Vectorized<T>;
  if constexpr (std::is_same_v<T, float>) {
    const V z = at::vec::minimum(at::vec::maximum(y, V(-9.f)), V(9.f));
    const V z2 = z * z;
    // scale rides on P's coefficients
    V p = V(1.8254990911999118e-11f * scale);
    p = at::vec::fmadd(p, z2, V(-1.2780316225106994e-08f * scale));
    p = at::vec::fmadd(p, z2, V(9.267370493286322e-06f * scale));
    p = at::vec::fmadd(p, z2, V(0.0029207555329809043f * scale));
    p = at::vec::fmadd(p, z2, V(0.1291922228931715f * scale));
    p = at::vec::fmadd(p, z2, V(0.9999999411956766f * scale));
    V q = V(0.00022809937599888665f);
    q = at::vec::fmadd(q, z2, V(0.023763141958005666f));
    q = at::vec::fmadd(q, z2, V(0.46252506145899247f));
    q = at::vec::fmadd(q, z2, V(1.f));
    return z * p / q;
  } else {
    const V one(T(1)), two(T(2)), small(T(1.0 / 64)), c3(T(-1.0 / 3)), c5(T(2.0 / 15));
    const V c7(T(-17.0 / 315));
    const V y2 = y * y;
    const V series = y * (one + y2 * (c3 + y2 * (c5 + y2 * c7)));
    const V far = one - two / ((y * two).exp() + one);
    return V::blendv(far, series, y.abs() < small) * V(scale);
  }
}

// With softcap the product q k^T is taken as s / softcap, tanh's argument, unless that factor is
// subnormal (a cap near the dtype's largest number): then the division comes after (folded:
// false).
template <typename T>
bool folds_cap(const Call<T>& c) {
  return c.softcap > 0 && c.scale / c.softcap >= double(std::numeric_limits<T>::min());
}

// The factor of the product q k^T that score_terms expects: scale * log2(e) (base 2), or with
// softcap scale / softcap (folded) or scale.
template <typename T>
T product_factor(const Call<T>& c) {
  if (c.softcap <= 0) return T(c.scale * kLog2e);
  return T(folds_cap(c) ? c.scale / c.softcap : c.scale);
}

template <typename T>
void score_terms(const Call<T>& c, int64_t n, int64_t hk, int64_t g, int64_t qs, const int64_t* vis,
                 int64_t col0, T* s, int64_t ld, T* t, const Window<T>& pos, bool skew);

// The keys ks + [first, end) of nk from ks that query i sees under the call's band (when
// c.band_alone(): a partial visit's only mask); first == end when it sees none.
template <typename T>
void band_run(const Call<T>& c, int64_t i, int64_t ks, int64_t nk, int64_t& first,
              int64_t& end) {
  const double base = double(i + c.shift - ks);
  const double f = std::ceil(base + c.lo), l = std::floor(base + c.hi);
  first = f <= 0 ? 0 : (f >= double(nk) ? nk : int64_t(f));
  end = l < 0 ? 0 : (l >= double(nk) ? nk : int64_t(l) + 1);
  end = std::max(end, first);
}

// Scores of one visit, rows r0:r1 of query block qs for head (n, hk, g), in base 2, into s
// (rows x keys, leading dimension ld). With softcap, tanh of the capped argument goes to t (the
// backward's; null in the forward, which does not need it).
template <typename T>
void scores(const Call<T>& c, int64_t n, int64_t hk, int64_t g, int64_t qs, const int64_t* vis,
            T* s, int64_t ld, T* t, const Window<T>& pos, const KeyPanels* panels = nullptr,
            bool skew = false) {
  const int64_t ks = vis[0], ke = vis[1], r0 = vis[2], r1 = vis[3];
  const T* qp = c.q.at(n, hk, g, qs + r0);
  times_keys<T>(c.register_tiles, panels, r1 - r0, ks, ke, c.Dk, product_factor(c), qp, c.q.ld(),
                c.k.at(n, hk, 0, ks), c.k.ld(), s, ld);
  score_terms(c, n, hk, g, qs, vis, 0, s, ld, t, pos, skew);
}

// What follows the product in a visit's scores (s holds product_factor(c) * q k^T): softcap, the
// position term, the bias and the mask. vis may be a stretch of a visit's keys (the decode path
// splits visits): col0 is the column of its first key in the visit's tile.
template <typename T>
void score_terms(const Call<T>& c, int64_t n, int64_t hk, int64_t g, int64_t qs, const int64_t* vis,
                 int64_t col0, T* s, int64_t ld, T* t, const Window<T>& pos, bool skew) {
  const int64_t ks = vis[0], ke = vis[1], r0 = vis[2], r1 = vis[3];
  const int64_t nr = r1 - r0, nk = ke - ks;
  const bool capped = c.softcap > 0;
  const bool fold = folds_cap(c);
  const int64_t h = hk * c.G + g;
  const T inf = std::numeric_limits<T>::infinity();
  using V = at::vec::Vectorized<T>;
  // softcap first: the position term, the bias and the mask come after tanh.
  for (int64_t r = 0; r < nr && capped; ++r) {
    T* row = s + r * ld;
    T* trow = t == nullptr ? nullptr : t + r * ld;
    // x * softcap * log2(e); for a huge cap, softcap * log2(e) would overflow: (x * cap) first.
    const V mul = V(T(fold ? c.softcap * kLog2e : c.softcap));
    const V cap = V(T(c.softcap)), l2e = V(T(kLog2e));
    int64_t j = 0;
    for (; j + V::size() <= nk; j += V::size()) {
      const V y = fold ? V::loadu(row + j) : V::loadu(row + j) / cap;
      if (trow == nullptr && fold) {
        tanh_of(y, T(c.softcap * kLog2e)).store(row + j);
        continue;
      }
      const V x = tanh_of(y);
      if (trow != nullptr) x.store(trow + j);
      (fold ? x * mul : x * mul * l2e).store(row + j);
    }
    for (; j < nk; ++j) {
      const T x = std::tanh(fold ? row[j] : row[j] / T(c.softcap));
      if (trow != nullptr) trow[j] = x;
      row[j] = fold ? x * T(c.softcap * kLog2e) : x * T(c.softcap) * T(kLog2e);
    }
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (skew) {  // the position term (the caller checked c.skew_fits)
      int64_t first, last;
      c.enc_rows(qs, vis, first, last);
      SkewPanels et;
      et.p = c.et + h * c.et_panels * KeyPanels::W * c.Dh;
      et.D = c.Dh;
      et.first = c.et_first;
      // Row r0's first key reads enc row first + nr - 1.
      add_skewed(nr, nk, c.qv.at(n, h, 0, qs + r0), c.qv.ld(), et, first + nr - 1,
                 float(c.rel_scale * kLog2e), s, ld);
    }
  }
#endif
  for (int64_t r = 0; r < nr; ++r) {
    T* row = s + r * ld;
    const int64_t i = qs + r0 + r;
    if (c.qv.p != nullptr && !skew) {
      const T* pr = pos.at(r0 + r, ks);
      int64_t j = 0;
      for (; j + V::size() <= nk; j += V::size()) {
        (V::loadu(row + j) + V::loadu(pr + j)).store(row + j);
      }
      for (; j < nk; ++j) row[j] += pr[j];
    }
    if (c.bias != nullptr) {
      const T* b = c.bias + n * c.bs[0] + hk * c.bs[1] + g * c.bs[2] + i * c.bs[3] + ks * c.bs[4];
      const int64_t st = c.bs[4];
      if (st == 1) {
        const V l2e = V(T(kLog2e));
        int64_t j = 0;
        for (; j + V::size() <= nk; j += V::size()) {
          at::vec::fmadd(V::loadu(b + j), l2e, V::loadu(row + j)).store(row + j);
        }
        for (; j < nk; ++j) row[j] += b[j] * T(kLog2e);
      } else {
        for (int64_t j = 0; j < nk; ++j) row[j] += b[j * st] * T(kLog2e);
      }
    }
    if (vis[4] && c.band_alone()) {
      // A band alone: two runs to hide.
      int64_t first, end;
      band_run(c, i, ks, nk, first, end);
      for (int64_t j = 0; j < first; ++j) row[j] = -inf;
      for (int64_t j = end; j < nk; ++j) row[j] = -inf;
    } else if (vis[4]) {
      for (int64_t j = 0; j < nk; ++j) {
        if (!c.partial_visible(n, h, i, ks + j, vis[5], r0 + r, col0 + j)) row[j] = -inf;
      }
    }
  }
}

// Dropout on rows of probabilities p (in place): kept entries scaled by 1 / (1 - p_drop).
template <typename T>
void drop(const Call<T>& c, int64_t n, int64_t h, int64_t i0, int64_t ks, int64_t nr, int64_t nk,
          T* p, int64_t ld) {
  const uint64_t thresh = c.drop_threshold();
  const T keep = T(1.0 / (1.0 - c.p_drop));
  for (int64_t r = 0; r < nr; ++r) {
    const uint64_t base = ((uint64_t)(n * c.Hkv * c.G + h) * c.Tq + i0 + r) * c.Tk + ks;
    T* row = p + r * ld;
    for (int64_t j = 0; j < nk; ++j) {
      row[j] = (splitmix64(base + j, c.seed) >> 40) >= thresh ? row[j] * keep : T(0);
    }
  }
}

template <typename T>
T row_max(const T* x, int64_t n) {
  using V = at::vec::Vectorized<T>;
  T m = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if (n >= V::size()) {
    V acc = V::loadu(x);
    for (j = V::size(); j + V::size() <= n; j += V::size())
      acc = at::vec::maximum(acc, V::loadu(x + j));
    m = at::vec::vec_reduce_all<T>([](V& a, V& b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; j < n; ++j) m = (std::isnan(x[j]) || x[j] > m) ? x[j] : m;
  return m;
}

// x = exp2(x - m) in place; returns the sum.
template <typename T>
T exp2_sum(T* x, int64_t n, T m) {
  using V = at::vec::Vectorized<T>;
  V acc(T(0));
  const V mv(m);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V e = (V::loadu(x + j) - mv).exp2();
    e.store(x + j);
    acc = acc + e;
  }
  T sum = at::vec::vec_reduce_all<T>([](V& a, V& b) { return a + b; }, acc);
  for (; j < n; ++j) {
    x[j] = std::exp2(x[j] - m);
    sum += x[j];
  }
  return sum;
}

template <typename T>
void scale_row(T* x, int64_t n, T a) {
  using V = at::vec::Vectorized<T>;
  const V av(a);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) (V::loadu(x + j) * av).store(x + j);
  for (; j < n; ++j) x[j] *= a;
}
// The keys (or values) of a query block's visits, packed for its products with q (or dO) when
// they run in register tiles (float32, AVX-512): at least 16 rows to share the packing, and at
// most 2^20 floats (4 MiB, past which a block's keys no longer stay in cache anyway).
template <typename T>
void pack_keys(const Call<T>& c, const Rows<const T*>& x, int64_t width, int64_t n, int64_t hk,
               int64_t qb, int64_t rows, KeyPanels& panels) {
  panels.ready = false;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (!c.register_tiles || rows < 16 || c.off[qb] == c.off[qb + 1]) return;
    int64_t k0 = c.Tk, k1 = 0;
    for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
      k0 = std::min(k0, c.visits[vi * 6]);
      k1 = std::max(k1, c.visits[vi * 6 + 1]);
    }
    k0 -= k0 % KeyPanels::W;
    if ((k1 - k0) * width > (int64_t(1) << 20)) return;
    panels.pack(x.at(n, hk, 0, k0), x.ld(), k0, k1, width);
  }
#else
  (void)c, (void)x, (void)width, (void)n, (void)hk, (void)qb, (void)rows;
#endif
}

}  // namespace
}  // namespace attnkit
