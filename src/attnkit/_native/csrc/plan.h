// The plan's reading: a call's tensors, its block plan and its mask as the kernel's items read
// them (Call), built from the operators' arguments (CallArgs) once every index has been checked.
#pragma once

#include "common.h"

namespace attnkit {

// A call's inputs as the operators receive them (see ops.cpp for their schemas).
struct CallArgs {
  at::Tensor q, k, v;  // (N, Hkv, G, Tq, Dk), (N, Hkv, Tk, Dk), (N, Hkv, Tk, Dv)
  at::Tensor offsets;  // (nqb + 1,) int64
  at::Tensor visits;   // (nv, 6) int64: ks, ke, r0, r1, partial, tile
  int64_t block_q = 0, block_k = 0;
  double scale = 1, softcap = 0;
  c10::optional<at::Tensor> bias;
  std::vector<int64_t> bias_layout;  // a bias by distance: 5 strides and a base, else empty
  std::vector<double> band;          // [lo, hi] or empty
  int64_t shift = 0;
  int64_t stretch = 0;  // the forward's order: query blocks per stretch, 0 for one stretch
  c10::optional<at::Tensor> key_ok, tiles;
  double p_drop = 0;
  int64_t seed = 0;
  c10::optional<at::Tensor> qv, enc;  // Transformer-XL's position term
  // Quantized keys and values' scales (the decode path's alone): float32 (N, Hkv, Tk) at any
  // strides (0 where broadcast); key j of (n, hk) is k[n, hk, j] * k_scale[n, hk, j].
  c10::optional<at::Tensor> k_scale, v_scale;
  double rel_scale = 0;
  int64_t top = 0, whole_width = 0;
  bool register_tiles = true, skewed_position = true;
};

// Internal linkage, as in one translation unit (see common.h).
namespace {

// q's dtype is the one the kernel computes in; keys and values come in it, or, for float32, in
// bfloat16 or float16, read as they are and converted in registers (half the bytes to read).
inline bool is_quantized_type(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// q's dtype is the one the kernel computes in; keys and values come in it, or, for float32, in
// bfloat16 or float16, read as they are and converted in registers (half the bytes to read), or
// where `quantized` (the decode path, with scales) in int8, float8_e4m3fn or float8_e5m2.
inline void check_dtypes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         bool quantized = false) {
  const at::ScalarType t = q.scalar_type(), kv = k.scalar_type();
  const bool reduced = kv == at::kBFloat16 || kv == at::kHalf;
  const bool narrow = quantized && is_quantized_type(kv);
  TORCH_CHECK(v.scalar_type() == kv && (kv == t || (t == at::kFloat && (reduced || narrow))),
              "attnkit: k and v must have q's dtype, or bfloat16/float16 with a float32 q",
              quantized ? " (or int8/float8 with their scales)" : "", "; got q ", t, ", k ", kv,
              " and v ", v.scalar_type());
}

// The dtype a call computes in: q's, float32 for bfloat16 queries (which only the forward on the
// matrix unit takes as they are; see forward.cpp).
inline at::ScalarType work_type(const at::Tensor& q) {
  return q.scalar_type() == at::kBFloat16 ? at::kFloat : q.scalar_type();
}

// f(T(), KV()) for a call computing in q's dtype T (float32 or float64) with keys and values of
// type KV (T, or bfloat16 or float16 with float32), as check_dtypes allows.
template <typename F>
void with_kv_types(const at::Tensor& q, const at::Tensor& k, const char* name, F&& f) {
  check_dtypes(q, k, k);
  if (q.scalar_type() == at::kDouble) {
    f(double(), double());
  } else if (q.scalar_type() != at::kFloat) {
    TORCH_CHECK(false, name, ": computes in float32 or float64, got q of ", q.scalar_type());
  } else if (k.scalar_type() == at::kBFloat16) {
    f(float(), at::BFloat16());
  } else if (k.scalar_type() == at::kHalf) {
    f(float(), at::Half());
  } else {
    f(float(), float());
  }
}

// Everything a call's items read: pointers into the tensors, and the plan.
template <typename T>
struct Call {
  int64_t N, Hkv, G, Tq, Tk, Dk, Dv, bq;
  Rows<const T*> q;       // (N, Hkv, G, Tq, Dk)
  // bfloat16 queries instead of q (unset), read by the matrix unit's forward (forward.cpp)
  Rows<const at::BFloat16*> q16;
  Rows<const T*> k;       // (N, Hkv, Tk, Dk)
  Rows<const T*> v;       // (N, Hkv, Tk, Dv)
  const int64_t* off;     // (nqb + 1): query block b visits visits[off[b] : off[b + 1]]
  const int64_t* visits;  // (nv, 6): ks, ke, r0, r1, partial, tile index
  int64_t nqb;
  // The forward's order: its items run in stretches of this many query blocks, every batch row
  // and key/value head of a stretch before the next stretch (a band's keys and the queries'
  // rows of all heads then stay in the caches); nqb for one stretch, each (batch, head) walking
  // every query block in turn.
  int64_t stretch;
  double scale, softcap;  // softcap <= 0: none
  // Where the build has AVX-512: float32 products with a row-major right operand in register
  // tiles rather than the BLAS, and the position term as products along the scores' diagonals
  // rather than per block's window of distances.
  bool register_tiles = true, skewed_position = true;
  // A (N, Hkv, G, Tq, Tk) view with strides bs (0 where broadcast), or a bias by distance: a
  // table whose element for (i, j) depends on j - i, strides -1 and 1 along i and j from a base
  // inside it (see attnkit.scores.DistanceBias).
  const T* bias = nullptr;
  int64_t bs[5] = {0, 0, 0, 0, 0};
  bool bias_aliased = false;  // pairs share elements of the bias (a bias by distance)
  bool band = false;
  double lo = 0, hi = 0;
  int64_t shift = 0;
  const uint8_t* key_ok = nullptr;  // (N|1, Tk)
  int64_t key_rows = 1;
  const uint8_t* tiles = nullptr;  // (P, Nm, Hm, bq, bk)
  int64_t tile_n = 1, tile_h = 1, tile_k = 1;
  double p_drop = 0;
  uint64_t seed = 0;
  // Transformer-XL's position term rel_scale * qv[n, h, i] . enc[h, top - (i + Tk - Tq - j)], 0
  // where that row is not in the table (see attnkit.scores.RelativePositionTerm).
  Rows<const T*> qv;       // (N, H, Tq, Dh)
  const T* enc = nullptr;  // (H, P, Dh), rows contiguous: head h's row e at h * enc_hs + e * enc_ld
  int64_t enc_hs = 0, enc_ld = 0;
  int64_t Dh = 0, P = 0, top = 0;
  double rel_scale = 0;
  // A query block whose product spans at most this many columns computes it once for all its
  // keys; a wider one computes it per visit (a GEMM whose output stays in the CPU's caches runs
  // markedly faster than one writing long rows).
  int64_t whole_width = 0;
  // enc^T for add_skewed (float32 with register tiles): (H, et_panels, Dh, W), SkewPanels of
  // the encodings et_first ... (zeros outside the table), every row in [et_first, et_last].
  const T* et = nullptr;
  int64_t et_panels = 0, et_first = 0, et_last = -1;
  // The same encodings row-major (H, et_panels * W, Dh), for the backward's skewed products.
  const T* ez = nullptr;
  // The rows of the backward's enc gradient buffers: encodings dfirst ... dfirst + drows - 1.
  int64_t dfirst = 0, drows = 0;

  const T* enc_row(int64_t h, int64_t e) const { return enc + h * enc_hs + e * enc_ld; }

  // Whether a partial visit's mask is the band alone (no key flags or tiles).
  bool band_alone() const { return band && key_ok == nullptr && tiles == nullptr; }

  bool partial_visible(int64_t n, int64_t h, int64_t i, int64_t j, int64_t tile, int64_t r,
                       int64_t c) const {
    if (band) {
      const double d = double(j - i - shift);
      if (d < lo || d > hi) return false;
    }
    if (key_ok != nullptr && !key_ok[(key_rows == 1 ? 0 : n) * Tk + j]) return false;
    if (tiles != nullptr) {
      const int64_t nm = tile_n == 1 ? 0 : n, hm = tile_h == 1 ? 0 : h;
      const int64_t at = (((tile * tile_n + nm) * tile_h + hm) * bq + r) * tile_k + c;
      if (!tiles[at]) return false;
    }
    return true;
  }

  // The forward's item number `item` as (batch n, key/value head hk, query block qb), in the
  // plan's order: stretch by stretch, and in a stretch (n, hk, qb) with qb fastest.
  void item_of(int64_t item, int64_t& n, int64_t& hk, int64_t& qb) const {
    const int64_t per = N * Hkv * stretch, s = item / per, at = item - s * per;
    const int64_t width = std::min(stretch, nqb - s * stretch), nh = at / width;
    qb = s * stretch + at % width;
    n = nh / Hkv;
    hk = nh % Hkv;
  }

  uint64_t drop_threshold() const { return (uint64_t)(p_drop * 16777216.0); }

  // The rows of enc a visit's terms read, e = top - (Tk - Tq) - i + j: [first, last].
  void enc_rows(int64_t qs, const int64_t* vis, int64_t& first, int64_t& last) const {
    const int64_t base = top - (Tk - Tq);
    first = base - (qs + vis[3] - 1) + vis[0];
    last = base - (qs + vis[2]) + vis[1] - 1;
  }

  // Whether add_skewed can add a visit's position term: et holds every row the visit reads, and
  // every row that a pair it may see reads is in the table. (A pair outside the table has the
  // term 0; add_skewed would give it qv . 0, which is NaN for an infinite qv, so only pairs the
  // mask hides, whose scores become -inf, may read et's zero margins.)
  bool skew_fits(int64_t qs, const int64_t* vis) const {
    if (et == nullptr) return false;
    int64_t first, last;
    enc_rows(qs, vis, first, last);
    if (first < et_first || last > et_last) return false;
    double seen_first = double(first), seen_last = double(last);
    if (band) {  // a pair is seen only if lo <= j - i - shift <= hi
      const double base = double(top - (Tk - Tq) + shift);
      seen_first = std::max(seen_first, base + lo);
      seen_last = std::min(seen_last, base + hi);
    }
    return seen_first > seen_last || (seen_first >= 0 && seen_last <= double(P - 1));
  }
};

// The plan (offsets, visits) of a call of Tq queries and Tk keys in blocks of block_q x block_k:
// query block b visits visits[offsets[b] : offsets[b + 1]], each visit's keys and rows inside
// the call and its block (every buffer is sized by the blocks).
inline void check_plan(const CallArgs& a, int64_t Tq, int64_t Tk) {
  const at::Tensor &off = a.offsets, &visits = a.visits;
  TORCH_CHECK(off.scalar_type() == at::kLong && off.dim() == 1 && off.is_contiguous() &&
                  visits.scalar_type() == at::kLong && visits.dim() == 2 && visits.size(1) == 6 &&
                  visits.is_contiguous(),
              "attnkit: a plan is contiguous int64 offsets (nqb + 1,) and visits (nv, 6), got ",
              off.scalar_type(), " ", off.sizes(), " and ", visits.scalar_type(), " ",
              visits.sizes());
  const int64_t nqb = (Tq + a.block_q - 1) / a.block_q;
  TORCH_CHECK(off.size(0) == nqb + 1, "attnkit: ", Tq, " queries in blocks of ", a.block_q,
              " make ", nqb, " query blocks, but the plan's offsets have ", off.size(0),
              " entries (one more than the blocks)");
  const int64_t* o = off.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[nqb] == visits.size(0), "attnkit: the plan's offsets run from ", o[0],
              " to ", o[nqb], ", not from 0 to its ", visits.size(0), " visits");
  for (int64_t b = 0; b < nqb; ++b) {
    TORCH_CHECK(o[b] <= o[b + 1], "attnkit: the plan's offsets decrease at block ", b);
    const int64_t rows = std::min(a.block_q, Tq - b * a.block_q);
    for (int64_t vi = o[b]; vi < o[b + 1]; ++vi) {
      const int64_t* vis = visits.data_ptr<int64_t>() + vi * 6;
      TORCH_CHECK(0 <= vis[0] && vis[0] <= vis[1] && vis[1] - vis[0] <= a.block_k && vis[1] <= Tk &&
                      0 <= vis[2] && vis[2] <= vis[3] && vis[3] <= rows,
                  "attnkit: visit ", vi, " (keys ", vis[0], ":", vis[1], ", rows ", vis[2], ":",
                  vis[3], ") lies outside query block ", b, " (", rows, " rows) or the call's ", Tk,
                  " keys in blocks of ", a.block_k);
    }
  }
}

// A dense bias (N|1, Hkv|1, G|1, Tq|1, Tk|1), or a bias by distance: a table and its layout (5
// strides and a base) such that every element read lies in the table.
template <typename T>
void read_bias(const CallArgs& a, Call<T>& c) {
  if (!a.bias.has_value()) {
    TORCH_CHECK(a.bias_layout.empty(), "attnkit: a bias layout without a bias");
    return;
  }
  const at::Tensor& bias = *a.bias;
  TORCH_CHECK(bias.scalar_type() == work_type(a.q), "attnkit: the bias must have q's dtype ",
              work_type(a.q), " (float32 with bfloat16 queries), got ", bias.scalar_type());
  const int64_t sizes[5] = {c.N, c.Hkv, c.G, c.Tq, c.Tk};
  if (a.bias_layout.empty()) {
    TORCH_CHECK(bias.dim() == 5, "attnkit: a dense bias is (N, Hkv, G, Tq, Tk), got ",
                bias.sizes());
    for (int d = 0; d < 5; ++d) {
      TORCH_CHECK(bias.size(d) == 1 || bias.size(d) == sizes[d], "attnkit: a bias of shape ",
                  bias.sizes(), " does not broadcast to (", c.N, ", ", c.Hkv, ", ", c.G, ", ", c.Tq,
                  ", ", c.Tk, ")");
      c.bs[d] = bias.size(d) == 1 ? 0 : bias.stride(d);
    }
    c.bias = bias.data_ptr<T>();
    return;
  }
  const std::vector<int64_t>& layout = a.bias_layout;
  TORCH_CHECK(layout.size() == 6 && bias.is_contiguous(),
              "attnkit: a bias layout is 5 strides and a base into a contiguous table");
  int64_t lo = layout[5], hi = layout[5];
  for (int d = 0; d < 5; ++d) {
    c.bs[d] = layout[d];
    const int64_t span = layout[d] * std::max<int64_t>(sizes[d] - 1, 0);
    lo += std::min<int64_t>(span, 0);
    hi += std::max<int64_t>(span, 0);
  }
  TORCH_CHECK(
      sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4] == 0 || (lo >= 0 && hi < bias.numel()),
      "attnkit: the bias layout reads elements ", lo, " to ", hi, " of a table of ", bias.numel());
  c.bias = bias.data_ptr<T>() + layout[5];
  c.bias_aliased = true;
}

// read_band and read_key_ok are inlined where they are called (make_call, cache_forward): left
// out of line, they shift GCC's inlining and cloning choices across the whole translation unit,
// the register tiles' among them.
#define ATTNKIT_PLAN_INLINE inline __attribute__((always_inline))

// A band [lo, hi] (a pair is seen only if lo <= j - i - shift <= hi; the caller sets the shift),
// or none (empty).
template <typename T>
ATTNKIT_PLAN_INLINE void read_band(const std::vector<double>& band, Call<T>& c) {
  if (band.size() == 2) {
    c.band = true;
    c.lo = band[0];
    c.hi = band[1];
  } else {
    TORCH_CHECK(band.empty(), "attnkit: band is [lo, hi] or empty, got ", band.size(), " numbers");
  }
}

// Key flags (N|1, Tk) = (c.N, c.Tk), or none; tk_is says in the message what Tk is, when it is not
// plainly the call's keys (it ends with ", ").
template <typename T>
ATTNKIT_PLAN_INLINE void read_key_ok(const c10::optional<at::Tensor>& key_ok, Call<T>& c,
                                     const char* tk_is) {
  if (!key_ok.has_value()) return;
  const at::Tensor& f = *key_ok;
  TORCH_CHECK(f.scalar_type() == at::kByte && f.dim() == 2 && f.is_contiguous() &&
                  (f.size(0) == 1 || f.size(0) == c.N) && f.size(1) == c.Tk,
              "attnkit: key_ok must be contiguous uint8 (N or 1, Tk) = (", c.N, ", ", c.Tk, "), ",
              tk_is, "got ", f.scalar_type(), " ", f.sizes());
  c.key_ok = f.data_ptr<uint8_t>();
  c.key_rows = f.size(0);
}

// Transformer-XL's position term: qv (N, H, Tq, Dh) and the encodings enc (H, P, Dh), rows
// contiguous.
template <typename T>
void read_position(const CallArgs& a, Call<T>& c) {
  if (!a.qv.has_value() || !a.enc.has_value()) {
    TORCH_CHECK(!a.qv.has_value() && !a.enc.has_value(),
                "attnkit: the position term needs both qv and enc");
    return;
  }
  const at::Tensor &qv = *a.qv, &enc = *a.enc;
  TORCH_CHECK(qv.scalar_type() == work_type(a.q) && enc.scalar_type() == work_type(a.q),
              "attnkit: qv and enc must have q's dtype (float32 with bfloat16 queries)");
  TORCH_CHECK(enc.dim() == 3 && (enc.stride(2) == 1 || enc.size(2) <= 1),
              "attnkit: enc is (H, P, Dh) with contiguous rows, got ", enc.sizes());
  TORCH_CHECK(qv.dim() == 4 && qv.size(0) == c.N && qv.size(1) == c.Hkv * c.G &&
                  qv.size(2) == c.Tq && qv.size(3) == enc.size(2),
              "attnkit: qv must be (N, H, Tq, Dh) = (", c.N, ", ", c.Hkv * c.G, ", ", c.Tq, ", ",
              enc.size(2), "), got ", qv.sizes());
  TORCH_CHECK(enc.size(0) == c.Hkv * c.G, "attnkit: enc must be (H, P, Dh) with H = ", c.Hkv * c.G,
              ", got ", enc.sizes());
  TORCH_CHECK(enc.size(1) <= 1 || enc.stride(1) >= enc.size(2),
              "attnkit: enc's rows must not overlap");
  TORCH_CHECK(a.whole_width >= 0, "attnkit: whole_width must be >= 0, got ", a.whole_width);
  c.qv = rows_of<const T*>(qv, qv.data_ptr<T>());
  c.enc = enc.data_ptr<T>();
  c.enc_hs = enc.stride(0);
  c.enc_ld = std::max<int64_t>(enc.stride(1), enc.size(2));
  c.Dh = enc.size(2);
  c.P = enc.size(1);
  c.top = a.top;
  c.rel_scale = a.rel_scale;
  c.whole_width = a.whole_width;
  c.drows = c.P;
}

// The call's pointers and the plan, after checking that every index the kernel will follow lies
// inside its tensor: the operators are public, and a wrong plan must raise, not read or write
// out of bounds.
template <typename T>
Call<T> make_call(const CallArgs& a) {
  const at::Tensor &q = a.q, &k = a.k, &v = a.v;
  TORCH_CHECK(q.dim() == 5 && k.dim() == 4 && v.dim() == 4,
              "attnkit: q must be (N, Hkv, G, Tq, Dk) and k, v (N, Hkv, Tk, D), got q of ", q.dim(),
              " dimensions, k of ", k.dim(), ", v of ", v.dim());
  check_dtypes(q, k, v, a.k_scale.has_value());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "attnkit: the native kernel runs on CPU tensors");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  v.size(1) == q.size(1) && v.size(2) == k.size(2) && k.size(3) == q.size(4),
              "attnkit: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " do not fit together");
  TORCH_CHECK(a.block_q > 0 && a.block_k > 0, "attnkit: block sizes must be positive, got ",
              a.block_q, " x ", a.block_k);
  Call<T> c;
  c.N = q.size(0);
  c.Hkv = q.size(1);
  c.G = q.size(2);
  c.Tq = q.size(3);
  c.Dk = q.size(4);
  c.Tk = k.size(2);
  c.Dv = v.size(3);
  c.bq = a.block_q;
  c.tile_k = a.block_k;
  c.register_tiles = a.register_tiles;
  c.skewed_position = a.skewed_position;
  if (q.scalar_type() == at::kBFloat16) {  // with bfloat16 keys and values (see forward.cpp)
    c.q16 = rows_of<const at::BFloat16*>(q, q.data_ptr<at::BFloat16>());
  } else {
    c.q = rows_of<const T*>(q, q.data_ptr<T>());
    if (k.scalar_type() == q.scalar_type()) {  // else the caller reads them (see check_dtypes)
      c.k = rows_of<const T*>(k, k.data_ptr<T>());
      c.v = rows_of<const T*>(v, v.data_ptr<T>());
    }
  }
  check_plan(a, c.Tq, c.Tk);
  c.off = a.offsets.data_ptr<int64_t>();
  c.visits = a.visits.data_ptr<int64_t>();
  c.nqb = a.offsets.size(0) - 1;
  TORCH_CHECK(a.stretch >= 0, "attnkit: stretch must be >= 0 query blocks, got ", a.stretch);
  c.stretch = a.stretch == 0 || a.stretch > c.nqb ? std::max<int64_t>(c.nqb, 1) : a.stretch;
  c.scale = a.scale;
  c.softcap = a.softcap;
  read_bias(a, c);
  read_band(a.band, c);
  if (c.band) c.shift = a.shift;
  read_key_ok(a.key_ok, c, "");
  if (a.tiles.has_value()) {
    const at::Tensor& t = *a.tiles;
    TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 5 && t.is_contiguous() &&
                    (t.size(1) == 1 || t.size(1) == c.N) &&
                    (t.size(2) == 1 || t.size(2) == c.Hkv * c.G) && t.size(3) == c.bq &&
                    t.size(4) == c.tile_k,
                "attnkit: tiles must be contiguous uint8 (P, N or 1, H or 1, block_q, block_k), "
                "got ",
                t.scalar_type(), " ", t.sizes());
    c.tiles = t.data_ptr<uint8_t>();
    c.tile_n = t.size(1);
    c.tile_h = t.size(2);
  }
  const int64_t n_tiles = a.tiles.has_value() ? a.tiles->size(0) : 0;
  for (int64_t vi = 0; vi < a.visits.size(0); ++vi) {
    const int64_t* vis = c.visits + vi * 6;
    TORCH_CHECK(!vis[4] || vis[5] < n_tiles, "attnkit: visit ", vi, " reads tile ", vis[5], " of ",
                n_tiles);
  }
  TORCH_CHECK(a.p_drop >= 0 && a.p_drop < 1, "attnkit: dropout_p must be in [0, 1), got ",
              a.p_drop);
  c.p_drop = a.p_drop;
  c.seed = (uint64_t)a.seed;
  read_position(a, c);
  return c;
}

}  // namespace
}  // namespace attnkit
