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
// G = H / C query heads together.
//
// The forward works on blocks of queries of one selection head, with all H / Hs query heads
// that read it: each query's visible keys are worked out once, and a selected key's rows for
// all those heads are read together (a copy of k and v with each key's heads side by side,
// see token_major). Each (query, head) keeps an online softmax, so that a query's keys may come
// in any order and only its accumulators stay between them. The block walks the keys in
// stretches of `span` keys, every query of the block taking its keys of one stretch before the
// next stretch: the stretch's rows then stay in the core's cache while the block's queries read
// them (nearby queries select many of the same keys), instead of coming from memory for each
// query. Reading the rows, not the arithmetic, is what the forward's time goes to.
//
// The backward (gathered_backward.h) works on blocks of one gathered head, walked the same way,
// each piece of a query's keys in one pass: its scores and dO . v, the weights and the scores'
// gradients, then the gradients' sums, while the piece's rows are in the first-level cache.

// common.h first: it reads the compiler's AVX-512 header with its false warnings off.
#include "common.h"

#include <torch/library.h>

namespace attnkit {
namespace {

// The backward's blocks: a block's selections and rows at most this many floats (16 MiB a
// thread), at most kBlockQueries queries, and a key stretch's rows (see walk) of kStretchBytes.
// It keeps no buffer per pair, so a block holds many queries: the more of them read each row of
// a stretch while the core's cache holds it, the fewer times the row comes from memory.
constexpr int64_t kBlockEntries = 1 << 22;
constexpr int64_t kBlockQueries = 1024;
constexpr int64_t kStretchBytes = 1 << 19;
// The forward's blocks: the more queries a block holds, the more of them read each row of a
// stretch while the core's cache holds it (each selects a few of the stretch's keys, at random),
// up to where their own rows and accumulators crowd the stretch's rows out; 16 MiB a thread.
constexpr int64_t kForwardEntries = 1 << 22;
constexpr int64_t kForwardQueries = 1024;
constexpr int64_t kForwardStretchBytes = 1 << 19;

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
    return visible_of(b, c / (C / Hs), t, out);
  }

  // The same for query t of (b, selection head s), which all the gathered heads of s share.
  int64_t visible_of(int64_t b, int64_t s, int64_t t, int32_t* out) const {
    const int64_t* row = keys + (((sel_rows > 1 ? b : 0) * Hs + s) * Tq + t) * W;
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

  // Natural-log scores from raw = scale * q . k, one vector.
  Vec cap(const Vec& s) const {
    if (softcap <= 0.0f) return s;
    return Vec(softcap) * (s * Vec(1.0f / softcap)).tanh();
  }
};

// One block of queries' selections: per query its visible keys, their count, and how far a
// walk over them has come.
struct Selected {
  int64_t W;
  std::vector<int32_t> idx;
  std::vector<int64_t> count, cursor;
  Selected(int64_t nq, int64_t w) : W(w), idx(nq * w), count(nq), cursor(nq) {}
};

// Walks the block's (query, selected key) pairs stretch by stretch of `span` keys: f(query, m0,
// m1) for each query's entries m0:m1 whose keys lie in the stretch, in order; f returns where
// that query's next entries start (m1, or beyond it where f took a few more).
template <typename F>
inline void walk(Selected& sel, int64_t nq, int64_t tk, int64_t span, F&& f) {
  std::fill(sel.cursor.begin(), sel.cursor.begin() + nq, 0);
  for (int64_t r1 = std::min(span, tk);; r1 = std::min(r1 + span, tk)) {
    for (int64_t i = 0; i < nq; ++i) {
      const int32_t* idx = sel.idx.data() + i * sel.W;
      const int64_t m0 = sel.cursor[i], n = sel.count[i];
      int64_t m = r1 >= tk ? std::max(n, m0) : m0;
      while (m < n && idx[m] < r1) ++m;
      if (m > m0) sel.cursor[i] = f(i, m0, m);
    }
    if (r1 >= tk) break;
  }
}

// Rows of k or v as the kernel reads them: the row of (batch row b, key/value head h, key j) at
// b * sb + h * sh + j * sj, whichever of (B, Hkv, Tk, D) and (B, Tk, Hkv, D) the layout is.
template <typename X>
struct Source {
  const X* p = nullptr;
  int64_t sb = 0, sh = 0, sj = 0;
  Source(const at::Tensor& t)
      : p(reinterpret_cast<const X*>(t.data_ptr())),
        sb(t.stride(0)),
        sh(t.stride(1)),
        sj(t.stride(2)) {}
};

// The forward's block: queries t0:t0+nq of one selection head s of batch row b, and the NH query
// heads that read that selection (all H / Hs of them, the gathered heads of s with their G query
// heads each, or one part of them: see head_parts).
// Each query's visible keys are worked out once for all of them, and each selected key's rows
// (one a head) are read together. Per (query, head) the scaled query row and an online softmax:
// the output accumulator, a score near the largest so far (see kSlack) and the sums of the
// weights relative to it, one a lane.
struct Forward {
  int64_t NH;
  Selected sel;
  std::vector<float> qs, acc, top, total;
  std::vector<int64_t> koff, voff;  // each head's key/value head, as an offset in a key's rows
  Forward(const Gather& g, int64_t nq, int64_t heads)
      : NH(heads),
        sel(nq, g.W),
        qs(nq * NH * g.Dk),
        acc(nq * NH * g.Dv),
        top(nq * NH),
        total(nq * NH * kLanes),
        koff(NH),
        voff(NH) {}
};

// The weights are taken relative to the largest score seen when it was last raised, which may
// lag behind the largest score so far by up to kSlack: weights up to e^kSlack, far from float32's
// range, and the accumulators rescaled only when a score passes that (for most pieces, never).
constexpr float kSlack = 8.0f;

inline bool any_above(const Vec& s, float x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cmp_ps_mask(__m512(s), _mm512_set1_ps(x), _CMP_GT_OQ) != 0;
#else
  alignas(64) float v[kLanes];
  s.store(v);
  return std::any_of(v, v + kLanes, [x](float e) { return e > x; });
#endif
}

inline float hmax(const Vec& x) {
  return at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x);
}

// The scores of one (query, head) row q with kLanes key rows (row[u] + off), one vector.
template <int VK, typename X>
inline Vec piece_scores(const float* q, const X* const* row, int64_t off, int64_t d) {
  if constexpr (VK > 0) {
    Vec qv[VK];
    for (int e = 0; e < VK; ++e) qv[e] = Vec::loadu(q + e * kLanes);
    Vec part[kLanes];
    for (int u = 0; u < kLanes; ++u) {
      const X* r = row[u] + off;
      Vec acc = load_as<float>(r) * qv[0];
      for (int e = 1; e < VK; ++e) acc = at::vec::fmadd(load_as<float>(r + e * kLanes), qv[e], acc);
      part[u] = acc;
    }
    return sums(part);
  } else {
    alignas(64) float s[kLanes];
    for (int u = 0; u < kLanes; ++u) s[u] = dot(q, row[u] + off, d);
    return Vec::loadu(s);
  }
}

// acc += sum over u < n of w[u] * (row[u] + off), d elements.
template <int VV, typename X>
inline void piece_values(float* acc, const float* w, const X* const* row, int64_t off, int64_t n,
                         int64_t d) {
  if constexpr (VV > 0) {
    Vec a[VV];
    for (int e = 0; e < VV; ++e) a[e] = Vec::loadu(acc + e * kLanes);
    for (int64_t u = 0; u < n; ++u) {
      const X* r = row[u] + off;
      const Vec wu(w[u]);
      for (int e = 0; e < VV; ++e) a[e] = at::vec::fmadd(load_as<float>(r + e * kLanes), wu, a[e]);
    }
    for (int e = 0; e < VV; ++e) a[e].store(acc + e * kLanes);
  } else {
    for (int64_t u = 0; u < n; ++u) add_scaled(acc, w[u], row[u] + off, d);
  }
}

// Query i's entries p:p+n (0 < n <= kLanes) with each of its heads: the scores, the online
// softmax's step (the accumulator rescaled where the largest score grows) and the weighted
// values. Lanes past n read entry p's rows again and get weight 0, so that every piece takes
// the vector path.
template <int VK, int VV, typename X>
void forward_piece(const Gather& g, Forward& f, const X* kb, int64_t kj, const X* vb, int64_t vj,
                   int64_t i, int64_t p, int64_t n) {
  const int32_t* idx = f.sel.idx.data() + i * g.W + p;
  const X* kr[kLanes];
  const X* vr[kLanes];
  for (int u = 0; u < kLanes; ++u) {
    const int64_t j = idx[u < n ? u : 0];
    kr[u] = kb + j * kj;
    vr[u] = vb + j * vj;
  }
  const Vec none(-std::numeric_limits<float>::infinity());
  alignas(64) float w[kLanes];
  for (int64_t r = 0; r < f.NH; ++r) {
    const int64_t ir = i * f.NH + r;
    Vec s = g.cap(piece_scores<VK>(f.qs.data() + ir * g.Dk, kr, f.koff[r], g.Dk));
    if (n < kLanes) s = Vec::set(none, s, n);
    float* acc = f.acc.data() + ir * g.Dv;
    float* total = f.total.data() + ir * kLanes;
    const float old = f.top[ir];
    if (any_above(s, old + kSlack)) {
      // (the first piece: old is -inf, and the accumulator and sums are 0 times 0)
      const float top = std::max(old, hmax(s)), scale = std::exp(old - top);
      for (int64_t e = 0; e < g.Dv; ++e) acc[e] *= scale;
      (Vec::loadu(total) * Vec(scale)).store(total);
      f.top[ir] = top;
    }
    const Vec e = (s - Vec(f.top[ir])).exp();
    (Vec::loadu(total) + e).store(total);
    e.store(w);
    piece_values<VV>(acc, w, vr, f.voff[r], n, g.Dv);
  }
}

// Queries t0:t0+nq of selection head s of batch row b, every head that reads the selection:
// out and lse written. The pairs are walked stretch by stretch (see walk), each query's keys
// of the stretch in pieces of kLanes.
template <int VK, int VV, typename X>
void forward_block(const Gather& g, const float* q, const Source<X>& k, const Source<X>& v,
                   float* out, float* lse, int64_t b, int64_t s, int64_t part, int64_t t0,
                   int64_t nq, int64_t span, Forward& f) {
  const int64_t NH = f.NH, W = g.W, Dk = g.Dk, Dv = g.Dv;
  const int64_t h0 = s * (g.H / g.Hs) + part * NH;  // the block's first query head in row b
  for (int64_t r = 0; r < NH; ++r) {
    const int64_t kv = (h0 + r) / (g.H / g.Hkv);
    f.koff[r] = kv * k.sh;
    f.voff[r] = kv * v.sh;
  }
  const int64_t head0 = b * g.H + h0;  // the block's first query head, of all B * H
  for (int64_t i = 0; i < nq; ++i) {
    f.sel.count[i] = g.visible_of(b, s, t0 + i, f.sel.idx.data() + i * W);
    for (int64_t r = 0; r < NH; ++r) {
      const float* row = q + ((head0 + r) * g.Tq + t0 + i) * Dk;
      const int64_t ir = i * NH + r;
      for (int64_t e = 0; e < Dk; ++e) f.qs[ir * Dk + e] = row[e] * g.scale;
      f.top[ir] = -std::numeric_limits<float>::infinity();
    }
  }
  std::fill(f.acc.begin(), f.acc.begin() + nq * NH * Dv, 0.0f);
  std::fill(f.total.begin(), f.total.begin() + nq * NH * kLanes, 0.0f);
  const X* kb = k.p + b * k.sb;
  const X* vb = v.p + b * v.sb;
  walk(f.sel, nq, g.Tk, span, [&](int64_t i, int64_t m0, int64_t m1) {
    const int64_t n = f.sel.count[i];
    int64_t m = m0;
    for (; m < m1; m += kLanes) {
      forward_piece<VK, VV>(g, f, kb, k.sj, vb, v.sj, i, m, std::min<int64_t>(kLanes, n - m));
    }
    return std::min(m, n);
  });
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t r = 0; r < NH; ++r) {
      const int64_t ir = i * NH + r, row = (head0 + r) * g.Tq + t0 + i;
      const float sum = hsum(Vec::loadu(f.total.data() + ir * kLanes));
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const float* a = f.acc.data() + ir * Dv;
      for (int64_t e = 0; e < Dv; ++e) out[row * Dv + e] = a[e] * inv;
      lse[row] = sum > 0.0f ? f.top[ir] + std::log(sum) : -std::numeric_limits<float>::infinity();
    }
  }
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

// The tensors' data in the kernel's layout: contiguous (a copy where they are not); with
// `strided_rows`, k and v at any strides whose rows hold their elements in order, as the forward
// reads them (a cache's rows, or values that are a view of the keys' rows: no copy of the whole
// cache for a few queries that each read k of its rows).
inline at::Tensor rows_of(const at::Tensor& t, bool strided_rows) {
  return strided_rows && t.stride(-1) == 1 ? t : t.contiguous();
}

struct Held {
  at::Tensor q, k, v, keys, key_ok;
  Held(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& keys_,
       const c10::optional<at::Tensor>& ok, bool strided_rows = false)
      : q(q_.contiguous()),
        k(rows_of(k_, strided_rows)),
        v(rows_of(v_, strided_rows)),
        keys(keys_.contiguous()) {
    if (ok.has_value()) key_ok = ok->contiguous();
  }
  void point(Gather& g) const {
    g.keys = keys.data_ptr<int64_t>();
    g.key_ok = key_ok.defined() ? key_ok.data_ptr<bool>() : nullptr;
  }
};

// Queries per forward block: at most kForwardQueries, their selections and rows within
// kForwardEntries floats, and fewer where that leaves too few blocks for every thread.
int64_t forward_queries(const Gather& g) {
  const int64_t NH = g.H / g.Hs;
  const int64_t per = g.W + NH * (g.Dk + g.Dv);
  int64_t nq = std::clamp<int64_t>(kForwardEntries / std::max<int64_t>(1, per), 1, kForwardQueries);
  const int64_t rows = g.B * g.Hs * g.Tq, want = 4 * int64_t(at::get_num_threads());
  if (rows < want * nq) nq = std::max<int64_t>(1, rows / want);
  return nq;
}

// How many parts a block's query heads (H / Hs) are cut into: 1, unless the call has fewer
// blocks than threads (a decode step: one query a row), where each part of the heads is an item
// of its own, so that every thread has one (the rows of a key are then read once a part).
int64_t head_parts(const Gather& g, int64_t blocks) {
  const int64_t NH = g.H / g.Hs, threads = at::get_num_threads();
  if (blocks >= threads) return 1;
  int64_t parts = 1;
  for (int64_t p = 2; p <= NH; ++p) {
    if (NH % p == 0 && blocks * parts < threads) parts = p;
  }
  return parts;
}

// k or v (B, Hkv, Tk, D) with each key's rows of every head side by side (strides of a (B, Tk,
// Hkv, D) tensor): a block reads a selected key's rows for all its heads at once, so they come
// as one run of memory rather than Hkv rows far apart (fewer pages, and the cache's own
// prefetchers fetch the run's next lines). A key's run is padded by one cache line: at a stride
// of a power of two (Hkv D elements often is one, 2 KiB at 8 heads of 64 float32) a head's rows
// of every key fall in the same few sets of the first-level cache, and a piece's sixteen keys'
// rows evict each other (see docs/latent-and-sparse.md for what it costs). A copy, made
// where the rows gathered outnumber the rows copied several times over (not for a few queries
// over a long cache), and where the heads lie apart or a key's stride is such a power of two.
at::Tensor token_major(const Gather& g, const at::Tensor& t) {
  if (g.Hkv < 2 || g.Hs * g.Tq * g.W < 8 * g.Tk) return t;
  const bool heads_apart = t.stride(1) > t.stride(2);
  const bool aliased = t.stride(2) * t.element_size() % 512 == 0;
  if (!heads_apart && !aliased) return t;
  const int64_t B = t.size(0), H = t.size(1), T = t.size(2), D = t.size(3);
  const at::Tensor runs = empty({B, T, H * D + 64 / t.element_size()}, t.options());
  const at::Tensor rows = runs.narrow(2, 0, H * D).view({B, T, H, D});
  rows.copy_(t.transpose(1, 2));
  return rows.transpose(1, 2);
}

template <typename X, int VK, int VV>
void run_forward(const Gather& g, const Held& t, at::Tensor& out, at::Tensor& lse, int64_t span) {
  const int64_t nq = forward_queries(g);
  const int64_t blocks = (g.Tq + nq - 1) / nq;
  const float* q = t.q.data_ptr<float>();
  const at::Tensor kt = token_major(g, t.k), vt = token_major(g, t.v);
  const Source<X> k(kt), v(vt);
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t parts = head_parts(g, g.B * g.Hs * blocks);
  const int64_t items = g.B * g.Hs * parts * blocks;
  parallel(0, items, 1, [&](int64_t, int64_t) {
    Forward f(g, nq, g.H / g.Hs / parts);
    for (int64_t item = claim(next); item < items; item = claim(next)) {
      const int64_t bsp = item / blocks, t0 = item % blocks * nq, bs = bsp / parts;
      forward_block<VK, VV, X>(g, q, k, v, o, l, bs / g.Hs, bs % g.Hs, bsp % parts, t0,
                               std::min(nq, g.Tq - t0), span, f);
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
  const Held t(q, k, v, keys, key_ok, /*strided_rows=*/true);
  t.point(g);
  at::Tensor out = empty({g.B, g.H, g.Tq, g.Dv}, q.options());
  at::Tensor lse = empty({g.B, g.H, g.Tq}, q.options());
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  // By default a stretch's rows (a key's of every key/value head a block reads) fill about a
  // quarter of the core's own cache: its queries' rows and accumulators take about as much.
  const int64_t heads = std::max<int64_t>(1, g.H / g.Hs * g.Hkv / g.H);
  const int64_t row = std::max<int64_t>(1, heads * (g.Dk + g.Dv) * k.element_size());
  const int64_t stretch = span > 0 ? span : std::max<int64_t>(kLanes, kForwardStretchBytes / row);
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
