// Attention statistics (attnkit.attention_stats) in one parallel region per call. Given each
// query's log-sum-exp, a visit's weights are final the moment its scores are: p = 2^(s - off)
// with off the row's log-sum-exp in base 2 (no running maximum, no rescaling). Items are
// (batch, key/value head, query block), claimed one at a time as in the forward; each computes
// the scores of every visit of its block for the G query heads of its key/value head (scores.h:
// the forward's register tiles, softcap, position term, bias and mask), then in one sweep over
// them p, the rows' sums of p t (t = s - off, the weights' base-2 logarithm: the entropy needs
// no log) and the columns' sums and maxima of p. A thread adds the columns of the head it works
// on into arrays of its own (G x Tk), and adds those into the outputs, under the head's lock,
// when it moves to another head and at the end: one q k^T and one exp2 per visible pair, and
// memory of the outputs' size plus a few tiles and two head-sized arrays per thread.

#include "kernel.h"
#include "position.h"
#include "scores.h"

namespace attnkit {
namespace {

// One thread's buffers: a visit's scores, the position term's window, the keys' panels, the
// block's rows' offsets and sums of p t, and the columns of the head it works on.
template <typename T>
struct StatsBuffers {
  std::vector<T> s, pos, off, plogp;
  KeyPanels panels;
  std::vector<T> mass, top;  // (G, Tk): sums and maxima of p since the last flush
  int64_t head = -1;         // n * Hkv + hk of the columns held, -1 for none
  int64_t lo = 0, hi = 0;    // the keys [lo, hi) they touch
  explicit StatsBuffers(const Call<T>& c)
      : s(c.bq * c.tile_k), pos(window_size(c)), off(c.bq), plogp(c.bq) {}
};

// The outputs (N, Hkv, G, Tk) of key mass and key maximum, and the heads' locks.
template <typename T>
struct Columns {
  T* mass;
  T* top;
  std::vector<std::mutex>& locks;
};

// Add a thread's columns into the outputs and clear them (nothing when it holds none).
template <typename T>
void flush(const Call<T>& c, StatsBuffers<T>& b, Columns<T>& out) {
  if (b.head < 0 || b.hi <= b.lo) return;
  using V = at::vec::Vectorized<T>;
  std::lock_guard<std::mutex> hold(out.locks[size_t(b.head)]);
  for (int64_t g = 0; g < c.G; ++g) {
    T* m = b.mass.data() + g * c.Tk;
    T* x = b.top.data() + g * c.Tk;
    T* om = out.mass + (b.head * c.G + g) * c.Tk;
    T* ox = out.top + (b.head * c.G + g) * c.Tk;
    int64_t j = b.lo;
    for (; j + V::size() <= b.hi; j += V::size()) {
      (V::loadu(om + j) + V::loadu(m + j)).store(om + j);
      at::vec::maximum(V::loadu(ox + j), V::loadu(x + j)).store(ox + j);
    }
    for (; j < b.hi; ++j) {
      om[j] += m[j];
      ox[j] = (std::isnan(x[j]) || x[j] > ox[j]) ? x[j] : ox[j];
    }
    std::fill(m + b.lo, m + b.hi, T(0));
    std::fill(x + b.lo, x + b.hi, T(0));
  }
  b.lo = b.hi = 0;
}

// R rows of a visit's scores (s, rows ld apart, nk keys), their offsets off: the columns' sums
// and maxima of p = 2^(s - off) into mass and top (the visit's first key's), and the rows' sums
// of p t into plogp. A masked pair (s = -inf) has t = -inf and p = 0, whose product would be
// NaN: t is raised to the dtype's lowest number first (0 * lowest = 0). The keys past the last
// full vector are read as -inf.
template <typename T, int R>
void add_rows(const T* s, int64_t ld, int64_t nk, const T* off, T* mass, T* top, T* plogp) {
  using V = at::vec::Vectorized<T>;
  const V lowest(std::numeric_limits<T>::lowest()), none(-std::numeric_limits<T>::infinity());
  V o[R], acc[R];
  for (int r = 0; r < R; ++r) {
    o[r] = V(off[r]);
    acc[r] = V(T(0));
  }
  auto step = [&](int64_t j, int64_t count) {
    const bool full = count == V::size();
    V m = full ? V::loadu(mass + j) : V::loadu(mass + j, count);
    V x = full ? V::loadu(top + j) : V::loadu(top + j, count);
    for (int r = 0; r < R; ++r) {
      const V sv = full ? V::loadu(s + r * ld + j) : V::set(none, V::loadu(s + r * ld + j, count), count);
      const V t = sv - o[r];
      const V p = t.exp2();
      m = m + p;
      x = at::vec::maximum(x, p);
      acc[r] = at::vec::fmadd(p, at::vec::maximum(t, lowest), acc[r]);
    }
    if (full) {
      m.store(mass + j);
      x.store(top + j);
    } else {
      m.store(mass + j, count);
      x.store(top + j, count);
    }
  };
  int64_t j = 0;
  for (; j + V::size() <= nk; j += V::size()) step(j, V::size());
  if (j < nk) step(j, nk - j);
  for (int r = 0; r < R; ++r) {
    plogp[r] += at::vec::vec_reduce_all<T>([](V& a, V& b) { return a + b; }, acc[r]);
  }
}

// A visit's rows (nr x nk scores in s, rows nk apart), four at a time: each column vector of
// mass and top is then read and written once for four rows.
template <typename T>
void add_visit(const T* s, int64_t nr, int64_t nk, const T* off, T* mass, T* top, T* plogp) {
  int64_t r = 0;
  for (; r + 4 <= nr; r += 4) add_rows<T, 4>(s + r * nk, nk, nk, off + r, mass, top, plogp + r);
  for (; r < nr; ++r) add_rows<T, 1>(s + r * nk, nk, nk, off + r, mass, top, plogp + r);
}

// Query head g of key/value head (n, hk) over query block qb: its rows' offsets from the
// log-sum-exp (natural log; -inf, a row that sees no key, gives +inf: its weights are 0), every
// visit's scores and their statistics, then the rows' entropies -ln 2 sum p t.
template <typename T>
void stats_head(const Call<T>& c, StatsBuffers<T>& b, int64_t n, int64_t hk, int64_t g,
                int64_t qb, bool skew, const T* lse, T* entropy) {
  const int64_t qs = qb * c.bq, rows = std::min(c.bq, c.Tq - qs), h = hk * c.G + g;
  const int64_t row0 = ((n * c.Hkv + hk) * c.G + g) * c.Tq + qs;
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const T l = lse[row0 + r];
    b.off[r] = l == -inf ? inf : T(l * kLog2e);
    b.plogp[r] = T(0);
  }
  const Window<T> whole = skew ? Window<T>() : block_window(c, qb, b.pos.data());
  if (whole.p != nullptr) whole.compute(c, n, h, qs);
  T* mass = b.mass.data() + g * c.Tk;
  T* top = b.top.data() + g * c.Tk;
  for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
    const int64_t* vis = c.visits + vi * 6;
    const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], nr = vis[3] - vis[2];
    Window<T> w = whole;
    if (c.qv.p != nullptr && whole.p == nullptr && !skew) {  // the visit's own window
      w = Window<T>(c, qs, vis[2], vis[3], vis[0], vis[1], b.pos.data());
      w.compute(c, n, h, qs);
    }
    scores(c, n, hk, g, qs, vis, b.s.data(), nk, static_cast<T*>(nullptr), w, &b.panels, skew);
    add_visit(b.s.data(), nr, nk, b.off.data() + r0, mass + ks, top + ks, b.plogp.data() + r0);
    b.lo = std::min(b.lo, ks);
    b.hi = std::max(b.hi, vis[1]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    entropy[row0 + r] = b.plogp[r] == T(0) ? T(0) : T(-kLn2) * b.plogp[r];
  }
}

// The whole pass. Within a head the query blocks are claimed last first: under a causal mask
// they are the longest, and the short ones then fill the region's end.
template <typename T>
void stats_impl(const Call<T>& c, const T* lse, T* mass, T* top, T* entropy) {
  const int64_t heads = c.N * c.Hkv, items = heads * c.nqb;
  std::vector<std::mutex> locks(static_cast<size_t>(heads));
  Columns<T> out{mass, top, locks};
  std::atomic<int64_t> next{0};
  parallel(0, items, 1, [&](int64_t, int64_t) {
    OneBlasThread one;
    StatsBuffers<T> b(c);
    for (int64_t item = claim(next); item < items; item = claim(next)) {
      const int64_t head = item / c.nqb, qb = c.nqb - 1 - item % c.nqb;
      if (c.off[qb] == c.off[qb + 1]) continue;  // rows that see no key: entropy 0, as set
      if (head != b.head) {
        flush(c, b, out);
        if (b.mass.empty()) {
          b.mass.assign(size_t(c.G * c.Tk), T(0));
          b.top.assign(size_t(c.G * c.Tk), T(0));
        }
        b.head = head;
        b.lo = c.Tk;
        b.hi = 0;
      }
      const int64_t n = head / c.Hkv, hk = head % c.Hkv;
      const int64_t rows = std::min(c.bq, c.Tq - qb * c.bq);
      pack_keys(c, c.k, c.Dk, n, hk, qb, rows, b.panels);
      const bool skew = skew_block(c, qb);
      for (int64_t g = 0; g < c.G; ++g) stats_head(c, b, n, hk, g, qb, skew, lse, entropy);
    }
    flush(c, b, out);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> stats(const CallArgs& a, const at::Tensor& lse) {
  TORCH_CHECK(a.q.dim() == 5 && a.k.dim() == 4,
              "attnkit::native_stats: q must be (N, Hkv, G, Tq, Dk) and k (N, Hkv, Tk, Dk), got ",
              a.q.sizes(), " and ", a.k.sizes());
  TORCH_CHECK((a.q.scalar_type() == at::kFloat || a.q.scalar_type() == at::kDouble) &&
                  a.k.scalar_type() == a.q.scalar_type(),
              "attnkit::native_stats: q and k must both be float32 or float64, got q ",
              a.q.scalar_type(), " and k ", a.k.scalar_type());
  TORCH_CHECK(a.p_drop == 0 && !a.k_scale.has_value() && !a.v_scale.has_value(),
              "attnkit::native_stats: the statistics take no dropout and no quantized keys");
  const std::vector<int64_t> rows = {a.q.size(0), a.q.size(1), a.q.size(2), a.q.size(3)};
  TORCH_CHECK(lse.scalar_type() == a.q.scalar_type() && lse.is_contiguous() &&
                  lse.sizes() == c10::IntArrayRef(rows),
              "attnkit::native_stats: lse must be contiguous (N, Hkv, G, Tq) = ",
              c10::IntArrayRef(rows),
              " of q's dtype ", a.q.scalar_type(), ", got ", lse.scalar_type(), " ", lse.sizes());
  const std::vector<int64_t> cols = {a.q.size(0), a.q.size(1), a.q.size(2), a.k.size(2)};
  at::Tensor mass = zeros(cols, a.q.options());
  at::Tensor top = zeros(cols, a.q.options());
  at::Tensor entropy = zeros(rows, a.q.options());
  AT_DISPATCH_FLOATING_TYPES(a.q.scalar_type(), "attnkit::native_stats", [&] {
    Call<scalar_t> c = make_call<scalar_t>(a);
    const auto tables = skew_table(c, a.enc);  // kept alive while the kernel reads them
    stats_impl(c, lse.data_ptr<scalar_t>(), mass.data_ptr<scalar_t>(), top.data_ptr<scalar_t>(),
               entropy.data_ptr<scalar_t>());
  });
  return {mass, top, entropy};
}

}  // namespace attnkit
