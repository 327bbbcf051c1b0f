// Index-selected attention: each query reads the key and value rows its selection names, by
// position, instead of scanning every key (torch.ops.attnkit.gathered_forward and
// gathered_backward; the caller is attnkit/_kernel/gathered.py, which gives the call's sorted
// selection and joins sinks afterwards).
//
// Layouts: q (B, H, Tq, Dk) float32; k (B, Hkv, Tk, Dk) and v (B, Hkv, Tk, Dv) in float32,
// bfloat16 or float16 (read as they are, computed in float32); keys (B|1, Hs, Tq, W) int64,
// each row sorted (-1 = none first, a repeated key beside its first entry, which alone counts).
// Query head h reads key/value head h / (H / Hkv) and selection head h / (H / Hs): the C =
// lcm(Hs, Hkv) "gathered heads" each read one key/value head with one selection, for their
// G = H / C query heads together, so each selected row is read once for all of them.
//
// The forward works on blocks of queries of one gathered head, in three phases: the scores of
// every selected pair, a softmax over each query's scores at once (its keys are all there, so no
// online rescaling), and the weighted sum of the values. The products walk the keys in stretches
// of `span` keys, every query of the block taking its keys of one stretch before the next
// stretch: the stretch's rows then stay in the core's cache while the block's queries read them
// (nearby queries select many of the same keys), instead of coming from memory for each query.

// common.h first: it reads the compiler's AVX-512 header with its false warnings off.
#include "common.h"

#include <torch/library.h>

namespace attnkit {
namespace {

// A row's scores and selected keys at most this many floats per block of queries (1 MiB).
constexpr int64_t kBlockEntries = 1 << 18;
// Queries per block at most.
constexpr int64_t kBlockQueries = 64;
// The bytes of one key stretch's rows by default (see walk).
constexpr int64_t kStretchBytes = 1 << 20;
// Selected rows fetched ahead of the one being read (their addresses are data: the hardware's
// prefetchers cannot guess them).
constexpr int64_t kAhead = 16;

inline float hsum(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(__m512(x));
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
#endif
}

// Scores come kLanes keys at a time, one vector of their sums.
constexpr int kLanes = Vec::size();

// The sums of kLanes vectors, lane u that of part[u].
inline Vec sums(const Vec* part) {
#if defined(CPU_CAPABILITY_AVX512)
  // Halving steps: neighbours' elements added pairwise, then 128-bit lanes, until each lane
  // holds one vector's sum (keys 0-3 in the first 128-bit lane, in order, and so on).
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = part[2 * i], b = part[2 * i + 1];
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
#else
  alignas(64) float out[kLanes];
  for (int u = 0; u < kLanes; ++u) out[u] = hsum(part[u]);
  return Vec::loadu(out);
#endif
}

// q . x over d elements (q in float32, x as it is).
template <typename X>
inline float dot(const float* q, const X* x, int64_t d) {
  Vec acc(0.0f);
  int64_t e = 0;
  for (; e + Vec::size() <= d; e += Vec::size()) {
    acc = at::vec::fmadd(load_as<float>(x + e), Vec::loadu(q + e), acc);
  }
  if (e < d) acc = at::vec::fmadd(load_as<float>(x + e, d - e), Vec::loadu(q + e, d - e), acc);
  return hsum(acc);
}

// out += w * x over d elements.
template <typename X>
inline void add_scaled(float* out, float w, const X* x, int64_t d) {
  const Vec wv(w);
  int64_t e = 0;
  for (; e + Vec::size() <= d; e += Vec::size()) {
    at::vec::fmadd(load_as<float>(x + e), wv, Vec::loadu(out + e)).store(out + e);
  }
  for (; e < d; ++e) out[e] += w * float(x[e]);
}

template <typename X>
inline void fetch_row(const X* row, int64_t d, bool write = false) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * int64_t(sizeof(X)); off += 64) {
    if (write) {
      __builtin_prefetch(p + off, 1, 3);
    } else {
      __builtin_prefetch(p + off, 0, 3);
    }
  }
}

// What a call is: its sizes, and the masks ANDed with the selection (bands and a key table),
// read at each pair.
struct Gather {
  int64_t B = 0, H = 0, Hkv = 0, Hs = 0, C = 0, G = 0, Tq = 0, Tk = 0, W = 0, Dk = 0, Dv = 0;
  int64_t sel_rows = 1;  // batch rows of the selection (1: shared by all)
  const int64_t* keys = nullptr;
  const bool* key_ok = nullptr;  // (B|1, Tk) or none
  int64_t key_ok_rows = 1;
  std::vector<double> band;  // (lo, hi, offset) triples: lo <= j - (i + offset) <= hi
  float scale = 1.0f, softcap = 0.0f;

  int64_t kv_head(int64_t c) const { return c / (C / Hkv); }

  // The keys query t of (b, gathered head c) attends, in order, each once: their count, at out.
  int64_t visible(int64_t b, int64_t c, int64_t t, int32_t* out) const {
    const int64_t* row =
        keys + (((sel_rows > 1 ? b : 0) * Hs + c / (C / Hs)) * Tq + t) * W;
    int64_t lo = 0, hi = Tk - 1;
    for (size_t i = 0; i + 3 <= band.size(); i += 3) {
      const double at = double(t) + band[i + 2];
      if (std::isfinite(band[i])) lo = std::max<int64_t>(lo, int64_t(std::ceil(band[i] + at)));
      if (std::isfinite(band[i + 1])) {
        hi = std::min<int64_t>(hi, int64_t(std::floor(band[i + 1] + at)));
      }
    }
    const bool* ok = key_ok == nullptr ? nullptr : key_ok + (key_ok_rows > 1 ? b : 0) * Tk;
    // Without branches: a random selection makes them unpredictable.
    int64_t n = 0, prev = -1;
    for (int64_t w = 0; w < W; ++w) {
      const int64_t j = row[w];
      out[n] = int32_t(j);
      n += int64_t(j != prev) & int64_t(j >= lo) & int64_t(j <= hi);  // (-1 is below lo)
      prev = j;
    }
    if (ok != nullptr) {
      int64_t kept = 0;
      for (int64_t m = 0; m < n; ++m) {
        out[kept] = out[m];
        kept += int64_t(ok[out[m]]);
      }
      n = kept;
    }
    return n;
  }

  // Natural-log scores from raw = scale * q . k, in place.
  void cap(float* s, int64_t n) const {
    if (softcap <= 0.0f) return;
    const Vec c(softcap), inv(1.0f / softcap);
    int64_t e = 0;
    for (; e + Vec::size() <= n; e += Vec::size()) {
      (c * (Vec::loadu(s + e) * inv).tanh()).store(s + e);
    }
    for (; e < n; ++e) s[e] = softcap * std::tanh(s[e] / softcap);
  }
};

// exp(s - top) in place over n scores; their sum.
inline float exp_sum(float* s, int64_t n, float top) {
  const Vec m(top);
  Vec total(0.0f);
  int64_t e = 0;
  for (; e + Vec::size() <= n; e += Vec::size()) {
    const Vec p = (Vec::loadu(s + e) - m).exp();
    p.store(s + e);
    total = total + p;
  }
  float sum = hsum(total);
  for (; e < n; ++e) {
    s[e] = std::exp(s[e] - top);
    sum += s[e];
  }
  return sum;
}

inline float max_of(const float* s, int64_t n) {
  Vec top(-std::numeric_limits<float>::infinity());
  int64_t e = 0;
  for (; e + Vec::size() <= n; e += Vec::size()) top = at::vec::maximum(top, Vec::loadu(s + e));
  float m = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top);
  for (; e < n; ++e) m = std::max(m, s[e]);
  return m;
}

// One block of queries' buffers: per query its visible keys and count, per (query, head) its
// scores (then weights) and output accumulator, and its scaled query rows.
struct Block {
  std::vector<int32_t> idx;
  std::vector<int64_t> count, cursor;
  std::vector<float> s, acc, qs, total;
  Block(const Gather& g, int64_t nq)
      : idx(nq * g.W),
        count(nq),
        cursor(nq),
        s(nq * g.G * g.W),
        acc(nq * g.G * g.Dv),
        qs(nq * g.G * g.Dk),
        total(nq * g.G) {}
};

// Walks the block's (query, selected key) pairs stretch by stretch of `span` keys: f(query, m0,
// m1) for each query's entries m0:m1 whose keys lie in the stretch, in order.
template <typename F>
inline void walk(Block& blk, int64_t nq, int64_t tk, int64_t span, F&& f) {
  const int64_t w = int64_t(blk.idx.size()) / int64_t(blk.count.size());
  std::fill(blk.cursor.begin(), blk.cursor.begin() + nq, 0);
  for (int64_t r1 = std::min(span, tk);; r1 = std::min(r1 + span, tk)) {
    for (int64_t i = 0; i < nq; ++i) {
      const int32_t* idx = blk.idx.data() + i * w;
      const int64_t m0 = blk.cursor[i];
      int64_t m = r1 >= tk ? blk.count[i] : m0;
      while (m < blk.count[i] && idx[m] < r1) ++m;
      if (m > m0) f(i, m0, m);
      blk.cursor[i] = m;
    }
    if (r1 >= tk) break;
  }
}

// The products of one query's keys idx[m0:m1] with its G heads, in pieces of kPiece keys: each
// piece's rows are read from memory for the first head and from the core's nearest cache for
// the others. Rows of VK (VV) vectors, a constant where the instantiation fixes it (0: any
// length, read element by element at the end).
constexpr int64_t kPiece = 64;

// The products of query i's rows (one a head: `rows` holds (query, head) rows of d elements)
// with its selected rows m0:m1 of `base`: out[(i G + h) W + m] = rows_ih . base_idx[m]. The
// scores (q scaled, k), or the backward's dO . v.
template <int VD, typename X>
void dots_run(const Gather& g, const Block& blk, const float* rows, int64_t d, const X* base,
              float* out, int64_t i, int64_t m0, int64_t m1) {
  const int64_t G = g.G, W = g.W, n = blk.count[i];
  const int32_t* idx = blk.idx.data() + i * W;
  for (int64_t p0 = m0; p0 < m1; p0 += kPiece) {
    const int64_t p1 = std::min(p0 + kPiece, m1);
    for (int64_t h = 0; h < G; ++h) {
      const float* q = rows + (i * G + h) * d;
      float* o = out + (i * G + h) * W;
      int64_t m = p0;
      if constexpr (VD > 0) {
        Vec qv[VD];
        for (int v = 0; v < VD; ++v) qv[v] = Vec::loadu(q + v * kLanes);
        for (; m + kLanes <= p1; m += kLanes) {
          Vec part[kLanes];
          for (int u = 0; u < kLanes; ++u) {
            if (h == 0 && m + u + kAhead < n) fetch_row(base + idx[m + u + kAhead] * d, d);
            const X* row = base + idx[m + u] * d;
            Vec acc = load_as<float>(row) * qv[0];
            for (int v = 1; v < VD; ++v) {
              acc = at::vec::fmadd(load_as<float>(row + v * kLanes), qv[v], acc);
            }
            part[u] = acc;
          }
          sums(part).store(o + m);
        }
      }
      for (; m < p1; ++m) {
        if (h == 0 && m + kAhead < n) fetch_row(base + idx[m + kAhead] * d, d);
        o[m] = dot(q, base + idx[m] * d, d);
      }
    }
  }
}

// The weighted sums of query i's values m0:m1 (every head), added into its accumulators.
template <int VV, typename X>
void value_run(const Gather& g, Block& blk, const X* vb, int64_t i, int64_t m0, int64_t m1) {
  const int64_t G = g.G, W = g.W, Dv = g.Dv, n = blk.count[i];
  const int32_t* idx = blk.idx.data() + i * W;
  for (int64_t p0 = m0; p0 < m1; p0 += kPiece) {
    const int64_t p1 = std::min(p0 + kPiece, m1);
    for (int64_t h = 0; h < G; ++h) {
      const float* w = blk.s.data() + (i * G + h) * W;
      float* acc = blk.acc.data() + (i * G + h) * Dv;
      if constexpr (VV > 0) {
        Vec a[VV];
        for (int v = 0; v < VV; ++v) a[v] = Vec::loadu(acc + v * Vec::size());
        for (int64_t m = p0; m < p1; ++m) {
          if (h == 0 && m + kAhead < n) fetch_row(vb + int64_t(idx[m + kAhead]) * Dv, Dv);
          const X* row = vb + int64_t(idx[m]) * Dv;
          const Vec wm(w[m]);
          for (int v = 0; v < VV; ++v) a[v] = at::vec::fmadd(load_as<float>(row + v * Vec::size()), wm, a[v]);
        }
        for (int v = 0; v < VV; ++v) a[v].store(acc + v * Vec::size());
      } else {
        for (int64_t m = p0; m < p1; ++m) {
          if (h == 0 && m + kAhead < n) fetch_row(vb + int64_t(idx[m + kAhead]) * Dv, Dv);
          add_scaled(acc, w[m], vb + int64_t(idx[m]) * Dv, Dv);
        }
      }
    }
  }
}

template <int VK, int VV, typename X>
void forward_block(const Gather& g, const float* q, const X* k, const X* v, float* out,
                   float* lse, int64_t b, int64_t c, int64_t t0, int64_t nq, int64_t span,
                   Block& blk) {
  const int64_t G = g.G, W = g.W, Dk = g.Dk, Dv = g.Dv;
  const int64_t kv = b * g.Hkv + g.kv_head(c);
  const X* kb = k + kv * g.Tk * Dk;
  const X* vb = v + kv * g.Tk * Dv;
  for (int64_t i = 0; i < nq; ++i) {
    blk.count[i] = g.visible(b, c, t0 + i, blk.idx.data() + i * W);
    for (int64_t h = 0; h < G; ++h) {
      const float* row = q + ((b * g.H + c * G + h) * g.Tq + t0 + i) * Dk;
      float* dst = blk.qs.data() + (i * G + h) * Dk;
      for (int64_t e = 0; e < Dk; ++e) dst[e] = row[e] * g.scale;
    }
  }
  // The scores of every pair.
  walk(blk, nq, g.Tk, span, [&](int64_t i, int64_t m0, int64_t m1) {
    dots_run<VK>(g, blk, blk.qs.data(), Dk, kb, blk.s.data(), i, m0, m1);
  });
  // The softmax of each (query, head), its keys all at once.
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t h = 0; h < G; ++h) {
      float* s = blk.s.data() + (i * G + h) * W;
      const int64_t n = blk.count[i];
      g.cap(s, n);
      const float top = n ? max_of(s, n) : 0.0f;
      const float sum = exp_sum(s, n, top);
      blk.total[i * G + h] = sum;
      lse[(b * g.H + c * G + h) * g.Tq + t0 + i] =
          n ? top + std::log(sum) : -std::numeric_limits<float>::infinity();
    }
  }
  // The weighted sums of the values.
  std::fill(blk.acc.begin(), blk.acc.begin() + nq * G * Dv, 0.0f);
  walk(blk, nq, g.Tk, span, [&](int64_t i, int64_t m0, int64_t m1) {
    value_run<VV>(g, blk, vb, i, m0, m1);
  });
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t h = 0; h < G; ++h) {
      const float sum = blk.total[i * G + h];
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const float* a = blk.acc.data() + (i * G + h) * Dv;
      float* o = out + ((b * g.H + c * G + h) * g.Tq + t0 + i) * Dv;
      for (int64_t e = 0; e < Dv; ++e) o[e] = a[e] * inv;
    }
  }
}

// Queries per block: at most kBlockQueries, their scores within kBlockEntries floats.
int64_t block_queries(const Gather& g) {
  return std::clamp<int64_t>(kBlockEntries / std::max<int64_t>(1, g.G * g.W), 1, kBlockQueries);
}

Gather gather_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& keys, const c10::optional<at::Tensor>& key_ok, double scale,
                 double softcap, c10::ArrayRef<double> band) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && keys.dim() == 4,
              "attnkit::gathered: q, k, v and keys are 4-d, got ", q.dim(), ", ", k.dim(), ", ",
              v.dim(), " and ", keys.dim());
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attnkit::gathered: q in float32, got ",
              q.scalar_type());
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 ||
                   k.scalar_type() == at::kHalf),
              "attnkit::gathered: k and v in one of float32, bfloat16, float16, got ",
              k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK(keys.scalar_type() == at::kLong, "attnkit::gathered: keys in int64, got ",
              keys.scalar_type());
  Gather g;
  g.B = q.size(0);
  g.H = q.size(1);
  g.Tq = q.size(2);
  g.Dk = q.size(3);
  g.Hkv = k.size(1);
  g.Tk = k.size(2);
  g.Dv = v.size(3);
  g.sel_rows = keys.size(0);
  g.Hs = keys.size(1);
  g.W = keys.size(3);
  TORCH_CHECK(k.size(0) == g.B && v.size(0) == g.B && k.size(3) == g.Dk &&
                  v.size(1) == g.Hkv && v.size(2) == g.Tk,
              "attnkit::gathered: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " do not fit together");
  TORCH_CHECK(g.Hkv > 0 && g.Hs > 0 && g.H % g.Hkv == 0 && g.H % g.Hs == 0,
              "attnkit::gathered: ", g.Hkv, " key/value heads and ", g.Hs,
              " selection heads must divide H = ", g.H);
  TORCH_CHECK((g.sel_rows == 1 || g.sel_rows == g.B) && keys.size(2) == g.Tq,
              "attnkit::gathered: keys ", keys.sizes(), " for B = ", g.B, ", Tq = ", g.Tq);
  TORCH_CHECK(g.Tk < (int64_t(1) << 31), "attnkit::gathered: Tk = ", g.Tk, " above 2^31");
  g.C = std::lcm(g.Hs, g.Hkv);
  g.G = g.H / g.C;
  if (key_ok.has_value()) {
    const at::Tensor& ok = *key_ok;
    TORCH_CHECK(ok.scalar_type() == at::kBool && ok.dim() == 2 && ok.size(1) == g.Tk &&
                    (ok.size(0) == 1 || ok.size(0) == g.B),
                "attnkit::gathered: key_ok is bool (B|1, Tk), got ", ok.scalar_type(), " ",
                ok.sizes());
    g.key_ok_rows = ok.size(0);
  }
  TORCH_CHECK(band.size() % 3 == 0, "attnkit::gathered: band holds (lo, hi, offset) triples, got ",
              band.size(), " numbers");
  g.band = band.vec();
  g.scale = float(scale);
  g.softcap = float(softcap);
  return g;
}

// The tensors' data in the kernel's layout: contiguous (a copy where they are not).
struct Held {
  at::Tensor q, k, v, keys, key_ok;
  Held(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& keys_,
       const c10::optional<at::Tensor>& ok)
      : q(q_.contiguous()), k(k_.contiguous()), v(v_.contiguous()), keys(keys_.contiguous()) {
    if (ok.has_value()) key_ok = ok->contiguous();
  }
  void point(Gather& g) const {
    g.keys = keys.data_ptr<int64_t>();
    g.key_ok = key_ok.defined() ? key_ok.data_ptr<bool>() : nullptr;
  }
};

template <typename X, int VK, int VV>
void run_forward(const Gather& g, const Held& t, at::Tensor& out, at::Tensor& lse, int64_t span) {
  const int64_t nq = block_queries(g);
  const int64_t blocks = (g.Tq + nq - 1) / nq;
  const float* q = t.q.data_ptr<float>();
  const X* k = reinterpret_cast<const X*>(t.k.data_ptr());
  const X* v = reinterpret_cast<const X*>(t.v.data_ptr());
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t items = g.B * g.C * blocks;
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    Block blk(g, nq);
    for (int64_t item = claim(next); item < items; item = claim(next)) {
      const int64_t bc = item / blocks, t0 = item % blocks * nq;
      forward_block<VK, VV, X>(g, q, k, v, o, l, bc / g.C, bc % g.C, t0, std::min(nq, g.Tq - t0),
                       span, blk);
    }
  });
}

// Rows of 4 or 8 vectors (64 or 128 float32 with AVX-512) have their loops unrolled, a query's
// rows and its output kept in registers; other lengths run the loops as they come.
template <typename X>
void run_forward_rows(const Gather& g, const Held& t, at::Tensor& out, at::Tensor& lse,
                      int64_t span) {
  if (g.Dk == 4 * kLanes && g.Dv == 4 * kLanes) return run_forward<X, 4, 4>(g, t, out, lse, span);
  if (g.Dk == 8 * kLanes && g.Dv == 8 * kLanes) return run_forward<X, 8, 8>(g, t, out, lse, span);
  run_forward<X, 0, 0>(g, t, out, lse, span);
}

std::tuple<at::Tensor, at::Tensor> gathered_forward(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& keys,
                                                    const c10::optional<at::Tensor>& key_ok,
                                                    double scale, double softcap,
                                                    c10::ArrayRef<double> band, int64_t span) {
  Gather g = gather_of(q, k, v, keys, key_ok, scale, softcap, band);
  const Held t(q, k, v, keys, key_ok);
  t.point(g);
  at::Tensor out = at::empty({g.B, g.H, g.Tq, g.Dv}, q.options());
  at::Tensor lse = at::empty({g.B, g.H, g.Tq}, q.options());
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  // By default a stretch's keys fill about half the core's own cache (1 MiB).
  const int64_t row = std::max<int64_t>(1, std::max(g.Dk, g.Dv) * k.element_size());
  const int64_t stretch = span > 0 ? span : std::max<int64_t>(kPiece, kStretchBytes / row);
  switch (k.scalar_type()) {
    case at::kBFloat16:
      run_forward_rows<at::BFloat16>(g, t, out, lse, stretch);
      break;
    case at::kHalf:
      run_forward_rows<at::Half>(g, t, out, lse, stretch);
      break;
    default:
      run_forward_rows<float>(g, t, out, lse, stretch);
  }
  return {out, lse};
}

}  // namespace
}  // namespace attnkit

#include "gathered_backward.h"

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def(
      "gathered_forward(Tensor q, Tensor k, Tensor v, Tensor keys, Tensor? key_ok=None, *, "
      "float scale, float softcap=0., float[] band=[], int span=0) -> (Tensor out, Tensor lse)");
  m.def(
      "gathered_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor keys, Tensor lse, "
      "Tensor delta, Tensor? key_ok=None, *, float scale, float softcap=0., float[] band=[]) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("gathered_forward", &attnkit::gathered_forward);
  m.impl("gathered_backward", &attnkit::gathered_backward);
}
