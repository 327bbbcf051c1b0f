// Transformer-XL's position term qv . enc[distance], added to the scores block by block: as
// register-tile products along the scores' diagonals (add_skewed, float32 with AVX-512), or as a
// product against each block's window of distances (Window), and their gradients.
#pragma once

#include "plan.h"
#include "tiles.h"

namespace attnkit {
// Internal linkage, as in one translation unit: each .cpp gets its own copy of these helpers,
// which the compiler then inlines and specialises freely (their hot loops depend on it).
namespace {

#if defined(CPU_CAPABILITY_AVX512)
// Transformer-XL's position term added to a visit's scores: C(r, j) += beta * T(r, j) with
// T(r, j) = qv_r . enc[e0 - r + j] (the skew: row r reads the encodings shifted by one per row).
// On the diagonals u = j - r the term is a plain product, T(r, u + r) = qv_r . enc[e0 + u], whose
// right operand is shared by all rows: register tiles of it as in tile(), each tile's rows then
// added to C at their own offset (lanes outside the visit's keys masked). The encodings come as
// enc^T in panels of W (SkewPanels), so that a tile reads contiguous, aligned vectors from a few
// pages. A tile of 6 rows covers the diagonals its rows need (keys + 5, rounded out to whole
// panels), so the term costs about what its pairs need, and neither the block's window of
// distances nor a pass adding it exist.

// Rows g .. g + R - 1 of C (n keys) += beta * (the tile over the NV vectors of diagonals from u0,
// a multiple of W away from the panels' origin). a: qv's row g; b: u0's panel, row 0.
template <int R, int NV>
inline void skew_tile(int64_t k, const float* a, int64_t lda, const float* b, int64_t vs,
                      float beta, float* c, int64_t ldc, int64_t g, int64_t u0, int64_t n) {
  constexpr int W = Vec::size();
  Vec acc[R][NV];
  sum_tile<R, NV>(acc, k, a, lda, 1, b, W, vs, 0);
  const __m512 be = _mm512_set1_ps(beta);
  if (u0 + g >= 0 && u0 + g + R - 1 + NV * W <= n) {  // every lane is a key
    for (int r = 0; r < R; ++r) {
      float* row = c + (g + r) * ldc + u0 + g + r;
      for (int v = 0; v < NV; ++v) {
        _mm512_storeu_ps(row + v * W, _mm512_fmadd_ps(acc[r][v], be, _mm512_loadu_ps(row + v * W)));
      }
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    float* row = c + (g + r) * ldc;
    for (int v = 0; v < NV; ++v) {
      const int64_t j = u0 + v * W + g + r;  // the key of the vector's first lane
      const int64_t lo = std::clamp<int64_t>(-j, 0, W), hi = std::clamp<int64_t>(n - j, 0, W);
      if (lo >= hi) continue;
      const __mmask16 mask = __mmask16(((1u << hi) - 1) & ~((1u << lo) - 1));
      const __m512 old = _mm512_maskz_loadu_ps(mask, row + j);
      _mm512_mask_storeu_ps(row + j, mask, _mm512_fmadd_ps(acc[r][v], be, old));
    }
  }
}

// enc^T of one head in panels of W encodings: panel i holds encodings first + W i ...; its row d
// (W floats) their d-th elements. Zeros outside the table.
struct SkewPanels {
  static constexpr int W = Vec::size();
  const float* p = nullptr;  // the head's first panel
  int64_t D = 0, first = 0;
  const float* panel(int64_t i) const { return p + i * W * D; }
};

// s (m x n, ld) += beta * T for m rows of qv (width D) and n keys, T(r, j) reading encoding
// e0 - r + j. Groups of 6 rows (and the rest) run innermost, over stretches of 4 vectors of their
// diagonals: the next group's stretch starts at most one panel before, so its panels are in L1.
inline void add_skewed(int64_t m, int64_t n, const float* qv, int64_t ldqv, const SkewPanels& et,
                       int64_t e0, float beta, float* s, int64_t ld) {
  constexpr int R = 6, W = Vec::size();
  const int64_t D = et.D, vs = W * D;
  const int64_t groups = (m + R - 1) / R;
  int64_t most = 0;  // vectors of the widest group
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t g = gi * R, rows = std::min<int64_t>(R, m - g);
    // Rows g .. g + rows - 1 need the encodings e0 - (g + rows - 1) ... e0 + n - 1 - g.
    const int64_t lo = e0 - (g + rows - 1) - et.first, hi = e0 + n - g - et.first;
    most = std::max(most, (hi + W - 1) / W - lo / W);
  }
  for (int64_t at = 0; at < most; at += 4) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t g = gi * R, rows = std::min<int64_t>(R, m - g);
      const int64_t lo = e0 - (g + rows - 1) - et.first, hi = e0 + n - g - et.first;
      const int64_t i0 = lo / W + at;              // this stretch's first panel
      const int64_t left = (hi + W - 1) / W - i0;  // its vectors
      if (left <= 0) continue;
      const int64_t u0 = i0 * W + et.first - e0;  // its first diagonal
      const float* a = qv + g * ldqv;
      const float* b = et.panel(i0);
#define ATTNKIT_SKEW(NR)                                                           \
  if (left >= 4) {                                                                 \
    skew_tile<NR, 4>(D, a, ldqv, b, vs, beta, s, ld, g, u0, n);                    \
  } else {                                                                         \
    for (int64_t v = 0; v < left; ++v)                                             \
      skew_tile<NR, 1>(D, a, ldqv, b + v * vs, vs, beta, s, ld, g, u0 + v * W, n); \
  }
      switch (rows) {
        case 6:
          ATTNKIT_SKEW(6) break;
        case 5:
          ATTNKIT_SKEW(5) break;
        case 4:
          ATTNKIT_SKEW(4) break;
        case 3:
          ATTNKIT_SKEW(3) break;
        case 2:
          ATTNKIT_SKEW(2) break;
        default:
          ATTNKIT_SKEW(1) break;
      }
#undef ATTNKIT_SKEW
    }
  }
}

// The gradients of add_skewed's term from its score gradient dS (m rows, n keys; dsp: row 0's
// key 0, rows ldp apart, with at least 5 zeros before and after each row's keys). On the
// diagonals both are plain products: dqv_r += alpha sum_u dS(r, u + r) enc[e0 + u], a tile of 6
// rows summing over the n + 5 diagonals they need (A read along the diagonal, stride ldp + 1), and
// denc[e0 + u] += alpha sum_r dS(r, u + r) qv_r, a tile of 6 diagonals summing over the rows that
// have keys on them. ez: enc's row e0 (row-major, width D, readable at every row a pair reads).
inline void skewed_dqv(int64_t m, int64_t n, int64_t D, const float* dsp, int64_t ldp,
                       const float* ez, float alpha, float* dqv, int64_t ldc) {
  constexpr int R = 6;
  for (int64_t g = 0; g < m; g += R) {
    const int64_t rows = std::min<int64_t>(R, m - g);
    // Row g + r's element p is its key p - (rows - 1) + r: diagonal p - (g + rows - 1).
    columns(rows, D, n + rows - 1, alpha, dsp + g * ldp - (rows - 1), ldp + 1, 1,
            ez - (g + rows - 1) * D, D, Vec::size(), 1, 1.f, dqv + g * ldc, ldc);
  }
}

// qvc: the m rows of qv, contiguous (width D); denc: enc's gradient at row e0 (width D).
inline void skewed_denc(int64_t m, int64_t n, int64_t D, const float* dsp, int64_t ldp,
                        const float* qvc, float alpha, float* denc) {
  constexpr int R = 6;
  for (int64_t u0 = -(m - 1); u0 < n; u0 += R) {
    const int64_t diagonals = std::min<int64_t>(R, n - u0);
    // Rows with a key on one of the diagonals u0 ... u0 + diagonals - 1.
    const int64_t r0 = std::max<int64_t>(0, -(u0 + diagonals - 1)), r1 = std::min(m, n - u0);
    if (r0 >= r1) continue;
    columns(diagonals, D, r1 - r0, alpha, dsp + r0 * ldp + u0 + r0, 1, ldp + 1, qvc + r0 * D, D,
            Vec::size(), 1, 1.f, denc + u0 * D, D);
  }
}
#endif

// Where the position term of a stretch of queries and keys lies in a product. The terms of rows
// R0:R1 of query block qs and keys K0:K1 read rows lo, lo + 1, ..., lo + width - 1 of enc, with
// lo = top - (Tk - Tq) - (qs + R1 - 1) + K0 and width = (K1 - K0) + (R1 - R0) - 1: the term of
// (row R, key j) is element (R1 - 1 - R) + (j - K0) of row R - R0 of the product
// qv[rows] @ enc[lo : lo + width]^T (the skew). Columns a:b of it exist in the table; the others
// are zeros.
template <typename T>
struct Window {
  int64_t R0 = 0, R1 = 0, K0 = 0, K1 = 0, lo = 0, width = 0, a = 0, b = 0;
  T* p = nullptr;  // the product, rows x width (the forward's) or its gradient (the backward's)

  Window() = default;
  Window(const Call<T>& c, int64_t qs, int64_t r0, int64_t r1, int64_t k0, int64_t k1, T* buf)
      : R0(r0), R1(r1), K0(k0), K1(k1), p(buf) {
    width = (K1 - K0) + (R1 - R0) - 1;
    lo = c.top - (c.Tk - c.Tq) - (qs + R1 - 1) + K0;
    a = std::clamp<int64_t>(-lo, 0, width);
    b = std::clamp<int64_t>(c.P - lo, a, width);
  }
  // The terms of row R from key ks on.
  T* at(int64_t R, int64_t ks) const { return p + (R - R0) * width + (R1 - 1 - R) + (ks - K0); }

  // p = rel_scale * log2(e) * qv[rows] @ enc[lo : lo + width]^T, zeros where enc has no row.
  void compute(const Call<T>& c, int64_t n, int64_t h, int64_t qs) const {
    const int64_t rows = R1 - R0;
    if (b > a) {
      gemm<T>(c.register_tiles, false, true, rows, b - a, c.Dh, T(c.rel_scale * kLog2e),
              c.qv.at(n, h, 0, qs + R0), c.qv.ld(), c.enc_row(h, lo + a), c.enc_ld, T(0), p + a,
              width);
    }
    if (a > 0 || b < width) zero_outside();
  }
  void zero_outside() const {
    for (int64_t r = 0; r < R1 - R0; ++r) {
      std::fill(p + r * width, p + r * width + a, T(0));
      std::fill(p + r * width + b, p + (r + 1) * width, T(0));
    }
  }
  // The backward of compute() for a gradient in p: dqv[rows] += rel_scale p enc[window] and
  // denc[window] += rel_scale p^T qv[rows] (either may be null: dqv.p, denc; dqv is laid out as
  // qv, denc a buffer of c.drows encodings from c.dfirst per head).
  void backward(const Call<T>& c, int64_t n, int64_t h, int64_t qs, const Rows<T*>& dqv,
                T* denc) const {
    if (b <= a) return;
    const int64_t rows = R1 - R0;
    if (dqv.p != nullptr) {
      gemm<T>(c.register_tiles, false, false, rows, c.Dh, b - a, T(c.rel_scale), p + a, width,
              c.enc_row(h, lo + a), c.enc_ld, T(1), dqv.at(n, h, 0, qs + R0), dqv.ld());
    }
    if (denc != nullptr) {
      gemm<T>(c.register_tiles, true, false, b - a, c.Dh, rows, T(c.rel_scale), p + a, width,
              c.qv.at(n, h, 0, qs + R0), c.qv.ld(), T(1),
              denc + (h * c.drows + lo + a - c.dfirst) * c.Dh, c.Dh);
    }
  }
};

// The window of a whole query block (keys of all its visits), or an empty one when that is wider
// than the call's whole_width or the call has no position term.
template <typename T>
Window<T> block_window(const Call<T>& c, int64_t qb, T* buf) {
  if (c.qv.p == nullptr || c.off[qb] == c.off[qb + 1]) return {};
  const int64_t qs = qb * c.bq, rows = std::min(c.bq, c.Tq - qs);
  int64_t k0 = c.Tk, k1 = 0;
  for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
    k0 = std::min(k0, c.visits[vi * 6]);
    k1 = std::max(k1, c.visits[vi * 6 + 1]);
  }
  if ((k1 - k0) + rows - 1 > c.whole_width) return {};
  return Window<T>(c, qs, 0, rows, k0, k1, buf);
}

// The buffer a window needs: the whole block's, or one visit's.
template <typename T>
int64_t window_size(const Call<T>& c) {
  if (c.qv.p == nullptr) return 0;
  const int64_t whole = std::min(c.whole_width, c.Tk + c.bq - 1);
  return c.bq * std::max(whole, c.tile_k + c.bq - 1);
}
// A visit's share of the position term's gradients (dqv, denc: either may be null) from its score
// gradient (dsp, ldp: see skewed_dqv), for a block whose term add_skewed added.
template <typename T>
void skew_backward(const Call<T>& c, int64_t n, int64_t h, int64_t qs, const int64_t* vis,
                   const T* dsp, int64_t ldp, const T* qvc, const Rows<T*>& dqv, T* denc) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    const int64_t nr = vis[3] - vis[2], nk = vis[1] - vis[0];
    int64_t first, last;
    c.enc_rows(qs, vis, first, last);
    const int64_t e0 = first + nr - 1;  // row vis[2]'s first key
    if (dqv.p != nullptr) {
      const float* ez = c.ez + (h * c.et_panels * KeyPanels::W + e0 - c.et_first) * c.Dh;
      skewed_dqv(nr, nk, c.Dh, dsp, ldp, ez, float(c.rel_scale), dqv.at(n, h, 0, qs + vis[2]),
                 dqv.ld());
    }
    if (denc != nullptr) {
      skewed_denc(nr, nk, c.Dh, dsp, ldp, qvc + vis[2] * c.Dh, float(c.rel_scale),
                  denc + (h * c.drows + e0 - c.dfirst) * c.Dh);
    }
    return;
  }
#endif
  (void)c, (void)n, (void)h, (void)qs, (void)vis, (void)dsp, (void)ldp, (void)qvc, (void)dqv;
  (void)denc;
}
// enc^T for add_skewed and enc row-major for the backward's skewed products (see Call::et and
// Call::ez), or nothing where they do not run: float32 with register tiles and a position term.
// Its columns are the rows of enc the plan's visits read, up to a block's rows and keys beyond
// the table (zeros there); a visit reading further takes the product of its window.
template <typename T>
std::vector<at::Tensor> skew_table(Call<T>& c, const c10::optional<at::Tensor>& enc) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (!c.register_tiles || !c.skewed_position || c.qv.p == nullptr) return {};
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
    for (int64_t qb = 0; qb < c.nqb; ++qb) {
      for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
        int64_t first, last;
        c.enc_rows(qb * c.bq, c.visits + vi * 6, first, last);
        lo = std::min(lo, first);
        hi = std::max(hi, last);
      }
    }
    const int64_t margin = c.bq + c.tile_k;
    lo = std::max(lo, -margin);
    hi = std::min(hi, c.P - 1 + margin);
    if (lo > hi) return {};
    // Whole panels of W encodings (add_skewed reads whole panels, the lanes beyond a tile's
    // pairs masked).
    constexpr int64_t W = Vec::size();
    const int64_t panels = (hi - lo + W) / W;
    const int64_t H = c.Hkv * c.G, D = c.Dh;
    at::Tensor ez = empty({H, panels * W, D}, enc->options());
    at::Tensor et = empty({H, panels, D, W}, enc->options());
    float* z = ez.data_ptr<float>();
    float* t = et.data_ptr<float>();
    // One pass per panel: its encodings row-major into ez and transposed into et.
    parallel(0, H * panels, 16, [&](int64_t begin, int64_t end) {
      for (int64_t x = begin; x < end; ++x) {
        const int64_t h = x / panels, i = x % panels;
        float* zp = z + (h * panels + i) * W * D;
        float* tp = t + (h * panels + i) * D * W;
        for (int64_t w = 0; w < W; ++w) {
          const int64_t e = lo + i * W + w;
          float* row = zp + w * D;
          if (e >= 0 && e < c.P) {
            std::copy(c.enc_row(h, e), c.enc_row(h, e) + D, row);
          } else {
            std::fill(row, row + D, 0.f);
          }
          for (int64_t d = 0; d < D; ++d) tp[d * W + w] = row[d];
        }
      }
    });
    c.et = et.data_ptr<float>();
    c.et_panels = panels;
    c.et_first = lo;
    c.et_last = hi;
    c.ez = ez.data_ptr<float>();
    c.dfirst = lo;
    c.drows = panels * W;
    return {et, ez};
  }
#endif
  (void)c, (void)enc;
  return {};
}

// Whether every visit of query block qb adds its position term by add_skewed (then no window of
// the term's product is computed for the block's scores).
template <typename T>
bool skew_block(const Call<T>& c, int64_t qb) {
  if (c.et == nullptr) return false;
  for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
    if (!c.skew_fits(qb * c.bq, c.visits + vi * 6)) return false;
  }
  return true;
}

}  // namespace
}  // namespace attnkit
