// Decoding: a few queries against a long cache, at the speed the cache streams from memory.
//
// The blocked forward runs each query head over all its keys in turn, so the G query heads of a
// key/value head read its keys and values G times, and a call with a few queries has too few query
// blocks to keep the threads busy. Here an item is (batch row, key/value heads, query block, part
// of the keys): it reads each step of its keys and values once, for the queries of every query head
// that shares them (rows ordered (query, head), so that a visit's rows r0:r1 of all heads are one
// stretch), and the parts of one row's keys (split-K) are merged exactly from their log-sum-exps by
// whichever thread finishes the last part, in the same call.
//
// Keys and values are read in place, as pages (X, Hkv, page, D) at any strides (in q's dtype, in
// bfloat16 or float16, or in int8 or float8 with a scale per row: see decode_pages.h): a cache
// laid out (B, Tk, Hkv, D) or (B, Hkv, Tk, D) is one page per batch row, and a paged cache is
// read through its block table, page by page (no gather).
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
//
// The files: decode_call.h (a call, its items and a thread's buffers), decode_pages.h (keys and
// values as pages, and the next step's rows asked for ahead), decode_tiles.h (the products of few
// rows in registers), decode_steps.h (a visit in steps: products, terms, online softmax, weighted
// values), decode_split_k.h (the parts of a row's keys merged); here, an item from its queries to
// its rows of out (run_item, decode_impl), how a call divides into items, and the entry points.

#include "kernel.h"

#include "decode_call.h"
#include "decode_split_k.h"
#include "decode_steps.h"
#include "share.h"

namespace attnkit {
namespace {

// A row's keys are split into parts only down to this many keys each.
constexpr int64_t kPartKeys = 512;
// A call starts a thread for every this many bytes of keys and values it reads (see divide).
constexpr int64_t kThreadBytes = int64_t(1) << 20;
// native_forward's calls of at most this many queries (in one query block) take the decode path.
constexpr int64_t kDecodeQueries = 16;

// The keys the plan's visits (of a call of one query block) span: [k0, k1), none when k1 <= k0.
template <typename T>
void visited_keys(const Call<T>& c, int64_t& k0, int64_t& k1) {
  k0 = c.Tk, k1 = 0;
  for (int64_t vi = c.off[0]; vi < c.off[1]; ++vi) {
    k0 = std::min(k0, c.visits[vi * 6]);
    k1 = std::max(k1, c.visits[vi * 6 + 1]);
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
    std::fill(b.lanes_first.begin(), b.lanes_first.end(), -1);
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
    int64_t k0 = 0, k1 = 0;
    visited_keys(c, k0, k1);
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
  auto body = [&] {
    int64_t item = claim(next);
    if (item >= items) return;  // a helper that came late
    OneBlasThread one;
    DecodeBuffers<T, KV> b(d);
    for (; item < items; item = claim(next)) {
      const Item it = item_of(d, item);
      load_queries(d, b, it);
      run_item(d, b, it, false);
      // NaN or inf in q, k or v: again, carefully (see add_terms).
      if (!finite_rows(d, b, it)) run_item(d, b, it, true);
      finish_item(d, b, parts, item, it, out, lse);
    }
  };
  // A thread for every d.grain items, as many as torch's intra-op threads.
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (items + d.grain - 1) / d.grain);
  share(threads - 1, body);
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

// f(T(), KV()) as with_kv_types gives it, and for a float32 call with scales int8 or float8 keys
// and values (KV int8_t, c10::Float8_e4m3fn or c10::Float8_e5m2).
template <typename F>
void with_decode_types(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& k_scale,
                       const c10::optional<at::Tensor>& v_scale, const char* name, F&& f) {
  const at::ScalarType kv = k.scalar_type();
  if (!is_quantized_type(kv)) {
    with_kv_types(q, k, name, f);
    return;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), name, ": ", kv,
              " keys and values take k_scale and v_scale");
  check_dtypes(q, k, v, true);
  if (kv == at::kChar) {
    f(float(), int8_t());
  } else if (kv == at::kFloat8_e4m3fn) {
    f(float(), c10::Float8_e4m3fn());
  } else {
    f(float(), c10::Float8_e5m2());
  }
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
  at::Tensor lse = empty({a.q.size(0), a.q.size(1), a.q.size(2), a.q.size(3)}, a.q.options());
  const char* name = "attnkit::native_forward";
  with_decode_types(a.q, a.k, a.v, a.k_scale, a.v_scale, name, [&](auto t, auto kv) {
    using T = decltype(t);
    using KV = decltype(kv);
    Decode<T, KV> d;
    d.c = make_call<T>(a);
    TORCH_CHECK(d.c.nqb <= 1, "attnkit: a decode call has one query block, got ", d.c.nqb);
    d.k = pages_of<KV>(a.k, a.k_scale, "k");
    d.v = pages_of<KV>(a.v, a.v_scale, "v");
    if (d.c.nqb == 0 || d.c.N * d.c.Hkv * d.c.G == 0) return;
    d.bq = d.c.Tq;
    d.nqb = 1;
    d.q_total = d.c.Tq;
    int64_t k0 = 0, k1 = 0;
    visited_keys(d.c, k0, k1);
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
  check_dtypes(q, k, v, a.k_scale.has_value());
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
  at::Tensor lse = empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  if (packed) {  // queries no row holds: no key
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
  }
  const char* name = "attnkit::native_cache_forward";
  with_decode_types(q, k, v, a.k_scale, a.v_scale, name, [&](auto t, auto kv) {
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
    // The band is relative to each row's alignment (its shift is set per row, see run_item).
    read_band(a.band, c);
    read_key_ok(a.key_ok, c, "Tk the longest row's end, ");
    d.k = pages_of<KV>(k, a.k_scale, "k");
    d.v = pages_of<KV>(v, a.v_scale, "v");
    if (N * c.Hkv * c.G * q_len == 0) return;
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
