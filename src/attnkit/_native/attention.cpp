// attnkit's native CPU kernel: the online softmax of attnkit._kernel.softmax, fused per block.
//
// One parallel region per call. The forward's work items are (batch, key/value head, query
// block); each runs every visited key block of its row of the block plan, for each of the G query
// heads that share the key/value head, with thread-local buffers: a GEMM for the scores, one pass
// for softcap, a product along the scores' diagonals for Transformer-XL's position term (see
// add_skewed), one pass for bias, mask and dropout, exp2 and the row sums, and a GEMM for the
// weighted values. q, k, v are read at the caller's strides (rows contiguous).
// The backward's items are (batch, key/value head, a stretch of query blocks): each recomputes
// its blocks' probabilities from the saved log-sum-exp and accumulates dq for its own rows and
// dk/dv for its key/value head, in place when it is the head's only stretch, else in its own
// buffer, summed after the parallel region. No two items write the same memory.
//
// Scores are kept in base 2 (log2(e) rides on the GEMM's alpha or on the adds), as in the eager
// kernel; the log-sum-exp returned is in natural units. A row that sees no key has log-sum-exp
// -inf and output 0; its probabilities in the backward are exp2(-inf - 0) = 0. Softcapped scores
// with nothing added are bounded by the cap: the forward's softmax then runs without a running
// maximum.
//
// Masks arrive as index arithmetic: a band lo <= j - (i + shift) <= hi, key flags (N|1, Tk), or
// bool tiles computed by the caller for the plan's partial blocks. FULL blocks do no mask work and
// EMPTY blocks are not in the plan.
//
// Dropout keeps a pair (n, h, i, j) iff the top 24 bits of splitmix64's output for the counter
// ((n * H + h) * Tq + i) * Tk + j (from the call's seed) are >= p * 2^24; the backward regenerates
// the same decisions. attnkit._kernel.dropout computes the same mask in PyTorch.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

extern "C" {
// The BLAS that torch links (weak: a build without it uses the loops below).
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*,
            const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*) __attribute__((weak));
// MKL's per-thread thread count (C interface); absent with another BLAS.
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

// Switches for A/B runs in one process (see the module's use_tiles and fuse_position); they take
// effect only where the build has AVX-512.
bool use_tiles = true;      // float32 products in register tiles (tile) instead of the BLAS
bool fuse_position = true;  // the position term along the diagonals (add_skewed)

// Sets a switch, returning its previous setting (false where the build has no AVX-512).
bool switch_to(bool& flag, bool on) {
#if defined(CPU_CAPABILITY_AVX512)
  const bool before = flag;
  flag = on;
  return before;
#else
  (void)flag, (void)on;
  return false;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// Products whose right operand is row-major (B(p, j) = b[p * ldb + j], j contiguous) in float32
// run in register tiles here instead of the BLAS: a tile of R rows of C by NV vectors of columns
// lives in R * NV of the 32 vector registers for the whole sum over p, each step loading NV
// vectors of B's row p and broadcasting R elements of A. Every such product in this kernel has
// the head's width as its columns (o += p v, dq += ds k, dk += ds^T q, dv += p^T do), so no
// packing is needed, and at these sizes (a few dozen to a few hundred rows, 64 columns) the
// BLAS's packing and dispatch on every call cost it a tenth to a third of its time.

// C rows (R of them) += or = alpha * sum_p A(i, p) B(p, :) over NV full vectors of columns, the
// last of them holding `tail` columns when tail > 0 (masked load and store).
// B's vector v of row p is at b + p * ldb + v * vs: vs = W for a row-major B, the panel size
// for K^T in panels (see KeyPanels).
// acc = sum_p A(r, p) B(p, :) for R rows and NV vectors (the last holding `tail` columns when
// tail > 0): the loop every register tile runs.
template <int R, int NV>
inline void sum_tile(Vec (&acc)[R][NV], int64_t k, const float* a, int64_t sai, int64_t sak,
                     const float* b, int64_t ldb, int64_t vs, int64_t tail) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec(0.f);
  for (int64_t p = 0; p < k; ++p) {
    Vec bv[NV];
    const float* bp = b + p * ldb;
    for (int v = 0; v < NV; ++v)
      bv[v] = (tail > 0 && v == NV - 1) ? Vec::loadu(bp + v * vs, tail) : Vec::loadu(bp + v * vs);
    const float* ap = a + p * sak;
    for (int r = 0; r < R; ++r) {
      const Vec x = Vec(ap[r * sai]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(x, bv[v], acc[r][v]);
    }
  }
}

template <int R, int NV>
inline void tile(int64_t k, float alpha, const float* a, int64_t sai, int64_t sak,
                 const float* b, int64_t ldb, int64_t vs, float beta, float* c, int64_t ldc,
                 int64_t tail) {
  constexpr int W = Vec::size();
  Vec acc[R][NV];
  sum_tile<R, NV>(acc, k, a, sai, sak, b, ldb, vs, tail);
  const Vec al(alpha), be(beta);
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      float* cp = c + r * ldc + v * W;
      const bool part = tail > 0 && v == NV - 1;
      Vec o = acc[r][v] * al;
      if (beta != 0.f) o = at::vec::fmadd(part ? Vec::loadu(cp, tail) : Vec::loadu(cp), be, o);
      if (part) {
        o.store(cp, tail);
      } else {
        o.store(cp);
      }
    }
  }
}

template <int NV>
void tile_rows(int64_t m, int64_t k, float alpha, const float* a, int64_t sai, int64_t sak,
               const float* b, int64_t ldb, int64_t vs, float beta, float* c, int64_t ldc,
               int64_t tail) {
  constexpr int R = 6;
  int64_t i = 0;
  for (; i + R <= m; i += R)
    tile<R, NV>(k, alpha, a + i * sai, sai, sak, b, ldb, vs, beta, c + i * ldc, ldc, tail);
  const float* ai = a + i * sai;
  float* ci = c + i * ldc;
  switch (m - i) {
    case 5: tile<5, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail); break;
    case 4: tile<4, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail); break;
    case 3: tile<3, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail); break;
    case 2: tile<2, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail); break;
    case 1: tile<1, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail); break;
    default: break;
  }
}

// C (m x n) = alpha * A B + beta * C in stretches of columns: 4 vectors, then 1, then a masked
// rest. Column j of B starts at b + j * step (1 for a row-major B; the width for panels), its
// vector v at + v * vs and its row p at + p * ldb.
void columns(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t sai,
             int64_t sak, const float* b, int64_t ldb, int64_t vs, int64_t step, float beta,
             float* c, int64_t ldc) {
  constexpr int W = Vec::size();
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W)
    tile_rows<4>(m, k, alpha, a, sai, sak, b + j * step, ldb, vs, beta, c + j, ldc, 0);
  for (; j + W <= n; j += W)
    tile_rows<1>(m, k, alpha, a, sai, sak, b + j * step, ldb, vs, beta, c + j, ldc, 0);
  if (j < n) {
    tile_rows<1>(m, k, alpha, a, sai, sak, b + j * step, ldb, vs, beta, c + j, ldc, n - j);
  }
}

// Row-major C (m x n) = alpha * A B + beta * C with A(i, p) = a[i * sai + p * sak] (A or A^T of
// a row-major matrix) and B row-major.
void tiled(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t sai,
           int64_t sak, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // Every tile of rows streams all of B. Rows of B far apart (v, k or q laid out token-major,
  // where a row's stride is all the heads' widths) fall on a few of L1's sets and evict each
  // other between tiles: B is copied into a contiguous thread-local buffer first when more than
  // one tile of rows reads it.
  if (ldb > n && m > 6) {
    thread_local std::vector<float> packed;
    if (packed.size() < size_t(k * n)) packed.resize(size_t(k * n));
    for (int64_t p = 0; p < k; ++p) std::copy(b + p * ldb, b + p * ldb + n, packed.data() + p * n);
    b = packed.data();
    ldb = n;
  }
  columns(m, n, k, alpha, a, sai, sak, b, ldb, Vec::size(), 1, beta, c, ldc);
}

// K^T for the keys [k0, k1) of one head, in panels of W keys: panel i holds keys k0 + W i ...,
// its row d (W floats) their d-th elements, so a product with q reads W keys' element d as one
// vector and a tile's NV vectors as NV contiguous streams. Made once per query block, before
// its visits, from keys laid out however the caller has them.
struct KeyPanels {
  static constexpr int W = Vec::size();
  std::vector<float> buf;
  int64_t k0 = 0, k1 = 0, D = 0;
  bool ready = false;

  void pack(const float* k, int64_t ld, int64_t first, int64_t last, int64_t width) {
    k0 = first, k1 = last, D = width;
    const int64_t panels = (k1 - k0 + W - 1) / W;
    if (buf.size() < size_t(panels * W * D)) buf.resize(size_t(panels * W * D));
    for (int64_t i = 0; i < panels; ++i) {
      const int64_t keys = std::min<int64_t>(W, k1 - k0 - i * W);
      float* dst = buf.data() + i * W * D;
      if (keys < W) std::fill(dst, dst + W * D, 0.f);
      at::vec::transpose_mxn<float>(k + (k0 + i * W) * ld, ld, dst, W, int(keys), int(D));
    }
    ready = true;
  }
  // Whether the keys [ks, ke) are packed, starting a panel.
  bool holds(int64_t ks, int64_t ke) const {
    return ready && ks >= k0 && ke <= k1 && (ks - k0) % W == 0;
  }
  // The panel of key ks (which holds() says is packed).
  const float* at(int64_t ks) const { return buf.data() + (ks - k0) / W * W * D; }
  // s (rows x (ke - ks), ld) = alpha * q[rows] k[ks:ke]^T.
  void scores(int64_t rows, int64_t ks, int64_t ke, float alpha, const float* q, int64_t ldq,
              float* s, int64_t ld) const {
    columns(rows, ke - ks, D, alpha, q, ldq, 1, at(ks), W, W * D, D, 0.f, s, ld);
  }
};

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
        _mm512_storeu_ps(row + v * W,
                         _mm512_fmadd_ps(acc[r][v], be, _mm512_loadu_ps(row + v * W)));
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
void add_skewed(int64_t m, int64_t n, const float* qv, int64_t ldqv, const SkewPanels& et,
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
      const int64_t i0 = lo / W + at;                 // this stretch's first panel
      const int64_t left = (hi + W - 1) / W - i0;      // its vectors
      if (left <= 0) continue;
      const int64_t u0 = i0 * W + et.first - e0;      // its first diagonal
      const float* a = qv + g * ldqv;
      const float* b = et.panel(i0);
#define ATTNKIT_SKEW(NR)                                                                   \
  if (left >= 4) {                                                                         \
    skew_tile<NR, 4>(D, a, ldqv, b, vs, beta, s, ld, g, u0, n);                            \
  } else {                                                                                 \
    for (int64_t v = 0; v < left; ++v)                                                     \
      skew_tile<NR, 1>(D, a, ldqv, b + v * vs, vs, beta, s, ld, g, u0 + v * W, n);         \
  }
      switch (rows) {
        case 6: ATTNKIT_SKEW(6) break;
        case 5: ATTNKIT_SKEW(5) break;
        case 4: ATTNKIT_SKEW(4) break;
        case 3: ATTNKIT_SKEW(3) break;
        case 2: ATTNKIT_SKEW(2) break;
        default: ATTNKIT_SKEW(1) break;
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
void skewed_dqv(int64_t m, int64_t n, int64_t D, const float* dsp, int64_t ldp, const float* ez,
                float alpha, float* dqv, int64_t ldc) {
  constexpr int R = 6;
  for (int64_t g = 0; g < m; g += R) {
    const int64_t rows = std::min<int64_t>(R, m - g);
    // Row g + r's element p is its key p - (rows - 1) + r: diagonal p - (g + rows - 1).
    columns(rows, D, n + rows - 1, alpha, dsp + g * ldp - (rows - 1), ldp + 1, 1,
            ez - (g + rows - 1) * D, D, Vec::size(), 1, 1.f, dqv + g * ldc, ldc);
  }
}

// qvc: the m rows of qv, contiguous (width D); denc: enc's gradient at row e0 (width D).
void skewed_denc(int64_t m, int64_t n, int64_t D, const float* dsp, int64_t ldp, const float* qvc,
                 float alpha, float* denc) {
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
#else
struct KeyPanels {
  bool ready = false;
  bool holds(int64_t, int64_t) const { return false; }
  void scores(int64_t, int64_t, int64_t, float, const float*, int64_t, float*, int64_t) const {}
};
#endif

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, op(A) m x k, op(B) k x n. A column-major
// BLAS computes C^T = op(B)^T op(A)^T: the operands swap, their flags stay.
template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (use_tiles && !tb) {
      tiled(m, n, k, alpha, a, ta ? 1 : lda, ta ? lda : 1, b, ldb, beta, c, ldc);
      return;
    }
  }
#endif
  const char fa = ta ? 'T' : 'N', fb = tb ? 'T' : 'N';
  const int M = (int)n, N = (int)m, K = (int)k, LA = (int)ldb, LB = (int)lda, LC = (int)ldc;
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_ != nullptr) {
      sgemm_(&fb, &fa, &M, &N, &K, &alpha, b, &LA, a, &LB, &beta, c, &LC);
      return;
    }
  } else {
    if (dgemm_ != nullptr) {
      dgemm_(&fb, &fa, &M, &N, &K, &alpha, b, &LA, a, &LB, &beta, c, &LC);
      return;
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      T sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        const T x = ta ? a[p * lda + i] : a[i * lda + p];
        const T y = tb ? b[j * ldb + p] : b[p * ldb + j];
        sum += x * y;
      }
      c[i * ldc + j] = alpha * sum + (beta == T(0) ? T(0) : beta * c[i * ldc + j]);
    }
  }
}

// out (rows x (ke - ks), ld) = alpha * a[rows] x[ks:ke]^T, x's rows (keys or values) at stride
// ldx: from the query block's panels of x when they hold those keys, else by the BLAS.
template <typename T>
void times_keys(const KeyPanels* panels, int64_t rows, int64_t ks, int64_t ke, int64_t width,
                T alpha, const T* a, int64_t lda, const T* x, int64_t ldx, T* out, int64_t ld) {
  if constexpr (std::is_same_v<T, float>) {
    if (panels != nullptr && panels->holds(ks, ke)) {
      panels->scores(rows, ks, ke, alpha, a, lda, out, ld);
      return;
    }
  }
  gemm<T>(false, true, rows, ke - ks, width, alpha, a, lda, x + ks * ldx, ldx, T(0), out, ld);
}

inline uint64_t splitmix64(uint64_t counter, uint64_t seed) {
  uint64_t z = seed + (counter + 1) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Rows of a (N, Hkv, G, T, D) tensor, or of a (N, X, T, D) one (its g stride 0), each row
// contiguous, at any strides between them: q, k and v come as views of the layout the caller has
// ((B, T, H, D) as well as (B, H, T, D)), and GEMMs read the rows with their stride as leading
// dimension.
template <typename P>
struct Rows {
  P p = nullptr;
  int64_t s[4] = {0, 0, 0, 0};  // strides of n, hk (or x), g, the row

  P at(int64_t n, int64_t hk, int64_t g, int64_t i) const {
    return p + n * s[0] + hk * s[1] + g * s[2] + i * s[3];
  }
  int64_t ld() const { return s[3]; }
};

template <typename P>
Rows<P> rows_of(const at::Tensor& t, P p) {
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, "rows must be contiguous");
  Rows<P> r;
  r.p = p;
  if (t.dim() == 5) {
    for (int d = 0; d < 4; ++d) r.s[d] = t.stride(d);
  } else {
    TORCH_CHECK(t.dim() == 4, "a 4-d or 5-d tensor");
    r.s[0] = t.stride(0);
    r.s[1] = t.stride(1);
    r.s[3] = t.stride(2);
  }
  // A leading dimension must be at least the row's length (for a single row, any will do).
  if (r.s[3] < std::max<int64_t>(t.size(-1), 1)) {
    TORCH_CHECK(t.size(-2) <= 1, "rows must not overlap");
    r.s[3] = std::max<int64_t>(t.size(-1), 1);
  }
  return r;
}

// Everything a call's items read: pointers into the tensors, and the plan.
template <typename T>
struct Call {
  int64_t N, Hkv, G, Tq, Tk, Dk, Dv, bq;
  Rows<const T*> q;  // (N, Hkv, G, Tq, Dk)
  Rows<const T*> k;  // (N, Hkv, Tk, Dk)
  Rows<const T*> v;  // (N, Hkv, Tk, Dv)
  const int64_t* off;     // (nqb + 1): query block b visits visits[off[b] : off[b + 1]]
  const int64_t* visits;  // (nv, 6): ks, ke, r0, r1, partial, tile index
  int64_t nqb;
  double scale, softcap;  // softcap <= 0: none
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
      gemm<T>(false, true, rows, b - a, c.Dh, T(c.rel_scale * kLog2e), c.qv.at(n, h, 0, qs + R0),
              c.qv.ld(), c.enc_row(h, lo + a), c.enc_ld, T(0), p + a, width);
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
      gemm<T>(false, false, rows, c.Dh, b - a, T(c.rel_scale), p + a, width, c.enc_row(h, lo + a),
              c.enc_ld, T(1), dqv.at(n, h, 0, qs + R0), dqv.ld());
    }
    if (denc != nullptr) {
      gemm<T>(true, false, b - a, c.Dh, rows, T(c.rel_scale), p + a, width,
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

// Scores of one visit, rows r0:r1 of query block qs for head (n, hk, g), in base 2, into s
// (rows x keys, leading dimension ld). With softcap, tanh of the capped argument goes to t (the
// backward's; null in the forward, which does not need it).
template <typename T>
void scores(const Call<T>& c, int64_t n, int64_t hk, int64_t g, int64_t qs, const int64_t* vis,
            T* s, int64_t ld, T* t, const Window<T>& pos, const KeyPanels* panels = nullptr,
            bool skew = false) {
  const int64_t ks = vis[0], ke = vis[1], r0 = vis[2], r1 = vis[3];
  const int64_t nr = r1 - r0, nk = ke - ks;
  const T* qp = c.q.at(n, hk, g, qs + r0);
  const bool capped = c.softcap > 0;
  // With softcap the GEMM gives s / softcap, tanh's argument, unless that factor is subnormal (a
  // cap near the dtype's largest number): then the division comes after.
  const bool fold = capped && c.scale / c.softcap >= double(std::numeric_limits<T>::min());
  const T alpha = T(!capped ? c.scale * kLog2e : (fold ? c.scale / c.softcap : c.scale));
  const int64_t h = hk * c.G + g;
  times_keys<T>(panels, nr, ks, ke, c.Dk, alpha, qp, c.q.ld(), c.k.at(n, hk, 0, 0), c.k.ld(), s,
                ld);
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
    if (vis[4] && c.band && c.key_ok == nullptr && c.tiles == nullptr) {
      // A band alone: row i sees keys ks + [first, last], two runs to hide.
      const double base = double(i + c.shift - ks);
      const double f = std::ceil(base + c.lo), l = std::floor(base + c.hi);
      const int64_t first = f <= 0 ? 0 : (f >= double(nk) ? nk : int64_t(f));
      const int64_t last = l < 0 ? -1 : (l >= double(nk) ? nk - 1 : int64_t(l));
      for (int64_t j = 0; j < std::min(first, nk); ++j) row[j] = -inf;
      for (int64_t j = std::max<int64_t>(last + 1, first); j < nk; ++j) row[j] = -inf;
    } else if (vis[4]) {
      for (int64_t j = 0; j < nk; ++j) {
        if (!c.partial_visible(n, h, i, ks + j, vis[5], r0 + r, j)) row[j] = -inf;
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
    for (j = V::size(); j + V::size() <= n; j += V::size()) acc = at::vec::maximum(acc, V::loadu(x + j));
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

// Inside the parallel region each item's GEMMs run on the calling thread: a BLAS that opened its
// own threads there would make every thread wait on the others' GEMMs.
struct OneBlasThread {
  int previous = 0;
  OneBlasThread() {
    if (MKL_Set_Num_Threads_Local != nullptr) previous = MKL_Set_Num_Threads_Local(1);
  }
  ~OneBlasThread() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous);
  }
};

// Each thread of a parallel region claims the next unclaimed item until none is left, instead
// of running a fixed share: on a core shared with another process a thread runs slower, and
// the others then take more of the items rather than wait for it at the region's end.
inline int64_t claim(std::atomic<int64_t>& next) {
  return next.fetch_add(1, std::memory_order_relaxed);
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
    if (!use_tiles || rows < 16 || c.off[qb] == c.off[qb + 1]) return;
    int64_t k0 = c.Tk, k1 = 0;
    for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
      k0 = std::min(k0, c.visits[vi * 6]);
      k1 = std::max(k1, c.visits[vi * 6 + 1]);
    }
    k0 -= k0 % KeyPanels::W;
    if ((k1 - k0) * width > (int64_t(1) << 20)) return;
    panels.pack(x.at(n, hk, 0, 0), x.ld(), k0, k1, width);
  }
#else
  (void)c, (void)x, (void)width, (void)n, (void)hk, (void)qb, (void)rows;
#endif
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

template <typename T>
void forward_impl(const Call<T>& c, const Rows<T*>& out, T* lse) {
  const int64_t items = c.N * c.Hkv * c.nqb;
  // Capped scores with nothing added lie in [-cap, cap] log2(e): with a cap of at most 69 their
  // exp2 are normal numbers whose sum over 2^20 keys stays finite, so the softmax needs no
  // running maximum (and no rescaling of the accumulated rows): it is taken as 0.
  const bool bounded = c.softcap > 0 && c.softcap * kLog2e <= 100.0 && c.bias == nullptr &&
                       c.qv.p == nullptr && c.Tk <= (int64_t(1) << 20);
  std::atomic<int64_t> next{0};  // items are claimed one at a time (see claim)
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    OneBlasThread one;
    const int64_t bk_max = c.tile_k;
    std::vector<T> s(c.bq * bk_max);
    std::vector<T> pos(window_size(c));
    std::vector<T> acc(c.bq * c.Dv), m(c.bq), l(c.bq);
    KeyPanels panels;
    for (int64_t item = claim(next); item < items; item = claim(next)) {
      const int64_t qb = item % c.nqb, nh = item / c.nqb, n = nh / c.Hkv, hk = nh % c.Hkv;
      const int64_t qs = qb * c.bq, rows = std::min(c.bq, c.Tq - qs);
      pack_keys(c, c.k, c.Dk, n, hk, qb, rows, panels);
      const bool skew = skew_block(c, qb);
      for (int64_t g = 0; g < c.G; ++g) {
        std::fill(acc.begin(), acc.end(), T(0));
        std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
        std::fill(l.begin(), l.end(), T(0));
        const Window<T> whole = skew ? Window<T>() : block_window(c, qb, pos.data());
        if (whole.p != nullptr) whole.compute(c, n, hk * c.G + g, qs);
        for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
          const int64_t* vis = c.visits + vi * 6;
          const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], nr = vis[3] - vis[2];
          Window<T> w = whole;
          if (c.qv.p != nullptr && whole.p == nullptr && !skew) {
            w = Window<T>(c, qs, r0, vis[3], ks, vis[1], pos.data());
            w.compute(c, n, hk * c.G + g, qs);
          }
          scores(c, n, hk, g, qs, vis, s.data(), nk, static_cast<T*>(nullptr), w, &panels, skew);
          for (int64_t r = 0; r < nr; ++r) {
            T* row = s.data() + r * nk;
            const int64_t R = r0 + r;
            if (bounded) {
              l[R] += exp2_sum(row, nk, T(0));
              m[R] = T(0);
              continue;
            }
            const T mnew = std::max(m[R], row_max(row, nk));
            const T safe = std::isinf(mnew) && mnew < 0 ? T(0) : mnew;
            const T alpha = std::exp2(m[R] - safe);
            l[R] = l[R] * alpha + exp2_sum(row, nk, safe);
            if (alpha != T(1)) scale_row(acc.data() + R * c.Dv, c.Dv, alpha);
            m[R] = mnew;
          }
          if (c.p_drop > 0) drop(c, n, hk * c.G + g, qs + r0, ks, nr, nk, s.data(), nk);
          gemm<T>(false, false, nr, c.Dv, nk, T(1), s.data(), nk, c.v.at(n, hk, 0, ks), c.v.ld(),
                  T(1), acc.data() + r0 * c.Dv, c.Dv);
        }
        const int64_t row0 = ((n * c.Hkv + hk) * c.G + g) * c.Tq + qs;
        for (int64_t r = 0; r < rows; ++r) {
          T* o = out.at(n, hk, g, qs + r);
          // A NaN sum (a NaN or +inf score the row sees) makes the row NaN, as in the reference;
          // only a row that sees no key gets zeros.
          if (l[r] > T(0) || std::isnan(l[r])) {
            const T inv = T(1) / l[r];
            for (int64_t d = 0; d < c.Dv; ++d) o[d] = acc[r * c.Dv + d] * inv;
            lse[row0 + r] = T((m[r] + std::log2(l[r])) * kLn2);
          } else {
            for (int64_t d = 0; d < c.Dv; ++d) o[d] = T(0);
            lse[row0 + r] = -std::numeric_limits<T>::infinity();
          }
        }
      }
    }
  });
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

// Rows t0:t1 of head (n, hk) of a (N, Hkv, T, D) gradient, set to 0.
template <typename T>
void zero_rows(const Rows<T*>& r, int64_t n, int64_t hk, int64_t t0, int64_t t1, int64_t d) {
  for (int64_t i = t0; i < t1; ++i) std::fill(r.at(n, hk, 0, i), r.at(n, hk, 0, i) + d, T(0));
}

// dbias (when not null) has the bias's own shape, contiguous, with strides ds (0 where broadcast).
// dqv (when dqv.p is not null) comes uninitialised, laid out as qv; denc (when not null) comes
// zeroed, head h's row e at h * dhs[0] + e * dhs[1].
template <typename T>
void backward_impl(const Call<T>& c, const Rows<const T*>& dout, const T* lse, const T* delta,
                   const Rows<T*>& dq, const Rows<T*>& dk, const Rows<T*>& dv, T* dbias,
                   const int64_t* ds,
                   int64_t dbias_numel, int64_t dbias_base, const Rows<T*>& dqv, T* denc,
                   const int64_t* dhs) {
  using V = at::vec::Vectorized<T>;
  // Stretches of query blocks per key/value head, enough for every thread to have work.
  const int64_t heads = c.N * c.Hkv;
  const int64_t threads = at::get_num_threads();
  // An empty batch (no heads) still gets one stretch: it divides nothing by zero.
  const int64_t parts = heads == 0 ? 1 : std::max<int64_t>(
      1, std::min<int64_t>(c.nqb, (2 * threads + heads - 1) / heads));
  // Stretches balanced by visits: stretch p holds query blocks first[p] : first[p + 1].
  std::vector<int64_t> first(parts + 1, c.nqb);
  first[0] = 0;
  {
    const int64_t total = c.off[c.nqb];
    int64_t p = 1;
    for (int64_t b = 0; b < c.nqb && p < parts; ++b) {
      if (c.off[b + 1] * parts >= p * total) first[p++] = b + 1;
    }
  }
  std::vector<int64_t> kmin(parts), kmax(parts);
  for (int64_t p = 0; p < parts; ++p) {
    kmin[p] = c.Tk;
    kmax[p] = 0;
    for (int64_t vi = c.off[first[p]]; vi < c.off[first[p + 1]]; ++vi) {
      kmin[p] = std::min(kmin[p], c.visits[vi * 6]);
      kmax[p] = std::max(kmax[p], c.visits[vi * 6 + 1]);
    }
  }
  std::vector<std::vector<T>> dk_parts(parts > 1 ? heads * parts : 0);
  std::vector<std::vector<T>> dv_parts(parts > 1 ? heads * parts : 0);
  // Every query block of every batch row adds to enc's gradient: each thread adds into its own.
  std::vector<std::vector<T>> denc_threads(denc != nullptr ? at::get_num_threads() : 0);
  const bool position = c.qv.p != nullptr && (dqv.p != nullptr || denc != nullptr);
  // A bias broadcast over the batch, the key/value heads or (with several stretches) the queries
  // has elements that several items add to: then the first thread adds into dbias, every
  // other into its own buffer of the bias's shape, summed into dbias after the parallel region.
  // Otherwise every item owns its part of dbias and adds in place.
  const bool dbias_shared =
      dbias != nullptr && (c.bias_aliased || (c.N > 1 && ds[0] == 0) ||
                           (c.Hkv > 1 && ds[1] == 0) || (parts > 1 && ds[3] == 0));
  std::mutex dbias_lock;
  std::vector<std::vector<T>> dbias_parts;
  std::atomic<int64_t> next{0};  // items are claimed one at a time (see claim)
  at::parallel_for(0, heads * parts, 1, [&](int64_t begin, int64_t) {
    OneBlasThread one;
    const int64_t bk_max = c.tile_k;
    std::vector<T> s(c.bq * bk_max), t(c.softcap > 0 ? c.bq * bk_max : 0), dp(c.bq * bk_max);
    std::vector<T> pos(window_size(c)), dpos(position ? window_size(c) : 0);
    // The score gradient with zeros around each row, and the block's rows of qv contiguous, for
    // skewed_dqv and skewed_denc.
    constexpr int64_t kPad = 16;
    const int64_t ldp = bk_max + 2 * kPad;
    std::vector<T> dsp(c.ez != nullptr ? c.bq * ldp : 0, T(0)), qvc(c.ez != nullptr ? c.bq * c.Dh : 0);
    T* denc_own = nullptr;
    if (denc != nullptr) {
      auto& own = denc_threads.at(at::get_thread_num());
      if (own.empty()) own.assign(c.Hkv * c.G * c.drows * c.Dh, T(0));
      denc_own = own.data();
    }
    std::vector<T> pd(c.p_drop > 0 ? c.bq * bk_max : 0), dqa(c.bq * c.Dk);
    KeyPanels kpanels, vpanels;
    std::vector<T> own_dbias(dbias_shared && begin > 0 ? dbias_numel : 0);
    T* db0 = own_dbias.empty() ? dbias : own_dbias.data();
    if (db0 != nullptr) db0 += dbias_base;
    for (int64_t item = claim(next); item < heads * parts; item = claim(next)) {
      const int64_t nh = item / parts, p = item % parts, n = nh / c.Hkv, hk = nh % c.Hkv;
      // dq, dk and dv come uninitialised: every item writes all of its rows.
      if (parts == 1) {
        zero_rows(dk, n, hk, 0, c.Tk, c.Dk);
        zero_rows(dv, n, hk, 0, c.Tk, c.Dv);
      }
      // dq and dqv too: every item writes its rows' (dqv's are summed, so zeroed first).
      for (int64_t g = 0; g < c.G && dqv.p != nullptr; ++g) {
        for (int64_t i = first[p] * c.bq; i < std::min(first[p + 1] * c.bq, c.Tq); ++i) {
          T* row = dqv.at(n, hk * c.G + g, 0, i);
          std::fill(row, row + c.Dh, T(0));
        }
      }
      if (kmax[p] <= kmin[p]) {
        for (int64_t g = 0; g < c.G; ++g) {
          for (int64_t i = first[p] * c.bq; i < std::min(first[p + 1] * c.bq, c.Tq); ++i) {
            std::fill(dq.at(n, hk, g, i), dq.at(n, hk, g, i) + c.Dk, T(0));
          }
        }
        continue;
      }
      T *dkh, *dvh;
      int64_t k0, lk, lv;  // the first key and the leading dimensions of dkh, dvh
      if (parts == 1) {
        dkh = dk.at(n, hk, 0, 0);
        dvh = dv.at(n, hk, 0, 0);
        lk = dk.ld();
        lv = dv.ld();
        k0 = 0;
      } else {
        lk = c.Dk;
        lv = c.Dv;
        auto& bk = dk_parts[item];
        auto& bv = dv_parts[item];
        bk.assign((kmax[p] - kmin[p]) * c.Dk, T(0));
        bv.assign((kmax[p] - kmin[p]) * c.Dv, T(0));
        dkh = bk.data();
        dvh = bv.data();
        k0 = kmin[p];
      }
      const T* kh = c.k.at(n, hk, 0, 0);
      const T* vh = c.v.at(n, hk, 0, 0);
      const int64_t ldk = c.k.ld(), ldv = c.v.ld();
      for (int64_t g = 0; g < c.G; ++g) {
        const int64_t h = hk * c.G + g;
        for (int64_t qb = first[p]; qb < first[p + 1]; ++qb) {
          const int64_t qs = qb * c.bq, rows = std::min(c.bq, c.Tq - qs);
          const int64_t row0 = (nh * c.G + g) * c.Tq + qs;
          std::fill(dqa.begin(), dqa.end(), T(0));
          pack_keys(c, c.k, c.Dk, n, hk, qb, rows, kpanels);
          pack_keys(c, c.v, c.Dv, n, hk, qb, rows, vpanels);
          const bool skew = skew_block(c, qb);
          // The position product, and its gradient (dwhole, dw: the same windows in dpos), unless
          // the block's term and its gradients are skewed products.
          const Window<T> whole = skew ? Window<T>() : block_window(c, qb, pos.data());
          Window<T> dwhole = whole;
          if (whole.p != nullptr) {
            whole.compute(c, n, h, qs);
            dwhole.p = dpos.data();
            if (position) std::fill(dpos.begin(), dpos.begin() + rows * whole.width, T(0));
          }
          if (skew && denc != nullptr) {
            for (int64_t r = 0; r < rows; ++r) {
              const T* src = c.qv.at(n, h, 0, qs + r);
              std::copy(src, src + c.Dh, qvc.data() + r * c.Dh);
            }
          }
          for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
            const int64_t* vis = c.visits + vi * 6;
            const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], nr = vis[3] - vis[2];
            Window<T> w = whole, dw = dwhole;
            if (c.qv.p != nullptr && whole.p == nullptr && !skew) {
              w = Window<T>(c, qs, r0, vis[3], ks, vis[1], pos.data());
              w.compute(c, n, h, qs);
              dw = w;
              dw.p = dpos.data();
              if (position) std::fill(dpos.begin(), dpos.begin() + nr * w.width, T(0));
            }
            scores(c, n, hk, g, qs, vis, s.data(), nk, t.data(), w, &kpanels, skew);
            for (int64_t r = 0; r < nr; ++r) {
              const T L = lse[row0 + r0 + r];
              const T base = (std::isinf(L) && L < 0) ? T(0) : T(L * kLog2e);
              exp2_sum(s.data() + r * nk, nk, base);
            }
            const T* dop = dout.at(n, hk, g, qs + r0);
            // dP = dO V^T (rows x keys)
            times_keys<T>(&vpanels, nr, ks, vis[1], c.Dv, T(1), dop, dout.ld(), vh, ldv, dp.data(),
                          nk);
            const T* pv = s.data();
            if (c.p_drop > 0) {
              std::copy(s.begin(), s.begin() + nr * nk, pd.begin());
              drop(c, n, h, qs + r0, ks, nr, nk, pd.data(), nk);
              // dP of the kept probabilities: the same mask and scale.
              for (int64_t x = 0; x < nr * nk; ++x) {
                dp[x] = s[x] > T(0) ? dp[x] * pd[x] / s[x] : T(0);
              }
              pv = pd.data();
            }
            // dV += P^T dO
            gemm<T>(true, false, nk, c.Dv, nr, T(1), pv, nk, dop, dout.ld(), T(1),
                    dvh + (ks - k0) * lv, lv);
            for (int64_t r = 0; r < nr; ++r) {
              const T dl = delta[row0 + r0 + r];
              T* pr = s.data() + r * nk;
              T* dr = dp.data() + r * nk;
              for (int64_t j = 0; j < nk; ++j) dr[j] = pr[j] * (dr[j] - dl);
              if (db0 != nullptr) {
                T* db = db0 + n * ds[0] + hk * ds[1] + g * ds[2] + (qs + r0 + r) * ds[3] +
                        ks * ds[4];
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
              // The term's score gradient, in its place in the product's gradient.
              if (position && skew) {
                T* row = dsp.data() + r * ldp;
                std::fill(row, row + kPad, T(0));
                std::copy(dr, dr + nk, row + kPad);
                std::fill(row + kPad + nk, row + 2 * kPad + nk, T(0));
              } else if (position) {
                std::copy(dr, dr + nk, dw.at(r0 + r, ks));
              }
              if (c.softcap > 0) {
                const T* tr = t.data() + r * nk;
                for (int64_t j = 0; j < nk; ++j) dr[j] *= T(1) - tr[j] * tr[j];
              }
            }
            if (position && skew) {
              skew_backward(c, n, h, qs, vis, dsp.data() + kPad, ldp, qvc.data(), dqv, denc_own);
            } else if (position && whole.p == nullptr) {
              dw.backward(c, n, h, qs, dqv, denc_own);
            }
            // dQ += scale dS K, dK += scale dS^T Q
            gemm<T>(false, false, nr, c.Dk, nk, T(c.scale), dp.data(), nk, kh + ks * ldk, ldk,
                    T(1), dqa.data() + r0 * c.Dk, c.Dk);
            gemm<T>(true, false, nk, c.Dk, nr, T(c.scale), dp.data(), nk, c.q.at(n, hk, g, qs + r0),
                    c.q.ld(), T(1), dkh + (ks - k0) * lk, lk);
          }
          if (position && whole.p != nullptr) dwhole.backward(c, n, h, qs, dqv, denc_own);
          for (int64_t r = 0; r < rows; ++r) {
            std::copy(dqa.begin() + r * c.Dk, dqa.begin() + (r + 1) * c.Dk, dq.at(n, hk, g, qs + r));
          }
        }
      }
    }
    if (!own_dbias.empty()) {
      std::lock_guard<std::mutex> lock(dbias_lock);
      dbias_parts.push_back(std::move(own_dbias));
    }
  });
  if (denc != nullptr) {
    // The buffers' rows that are rows of enc, into denc.
    const int64_t e0 = std::max<int64_t>(0, c.dfirst), e1 = std::min(c.P, c.dfirst + c.drows);
    const int64_t per_head = std::max<int64_t>(0, e1 - e0);
    at::parallel_for(0, c.Hkv * c.G * per_head, 64, [&](int64_t begin, int64_t end) {
      for (const auto& own : denc_threads) {
        if (own.empty()) continue;
        for (int64_t x = begin; x < end; ++x) {
          const int64_t h = x / per_head, e = e0 + x % per_head;
          T* to = denc + h * dhs[0] + e * dhs[1];
          const T* from = own.data() + (h * c.drows + e - c.dfirst) * c.Dh;
          for (int64_t d = 0; d < c.Dh; ++d) to[d] += from[d];
        }
      }
    });
  }
  if (!dbias_parts.empty()) {
    at::parallel_for(0, dbias_numel, 4096, [&](int64_t begin, int64_t end) {
      for (const auto& part : dbias_parts) {
        for (int64_t x = begin; x < end; ++x) dbias[x] += part[x];
      }
    });
  }
  if (parts > 1) {
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nh = begin; nh < end; ++nh) {
        const int64_t n = nh / c.Hkv, hk = nh % c.Hkv;
        zero_rows(dk, n, hk, 0, c.Tk, c.Dk);
        zero_rows(dv, n, hk, 0, c.Tk, c.Dv);
        for (int64_t p = 0; p < parts; ++p) {
          const auto& bk = dk_parts[nh * parts + p];
          const auto& bv = dv_parts[nh * parts + p];
          if (bk.empty()) continue;
          for (int64_t j = 0; j < kmax[p] - kmin[p]; ++j) {
            T* rk = dk.at(n, hk, 0, kmin[p] + j);
            T* rv = dv.at(n, hk, 0, kmin[p] + j);
            for (int64_t d = 0; d < c.Dk; ++d) rk[d] += bk[j * c.Dk + d];
            for (int64_t d = 0; d < c.Dv; ++d) rv[d] += bv[j * c.Dv + d];
          }
        }
      }
    });
  }
}

template <typename T>
Call<T> make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& off, const at::Tensor& visits, int64_t block_q,
                  int64_t block_k, double scale, double softcap,
                  const c10::optional<at::Tensor>& bias, const std::vector<int64_t>& layout,
                  std::vector<double> band, int64_t shift,
                  const c10::optional<at::Tensor>& key_ok, const c10::optional<at::Tensor>& tiles,
                  double p_drop, int64_t seed, const c10::optional<at::Tensor>& qv,
                  const c10::optional<at::Tensor>& enc, double rel_scale, int64_t top,
                  int64_t whole_width) {
  Call<T> c;
  c.N = q.size(0);
  c.Hkv = q.size(1);
  c.G = q.size(2);
  c.Tq = q.size(3);
  c.Dk = q.size(4);
  c.Tk = k.size(2);
  c.Dv = v.size(3);
  c.bq = block_q;
  c.tile_k = block_k;
  c.q = rows_of<const T*>(q, q.data_ptr<T>());
  c.k = rows_of<const T*>(k, k.data_ptr<T>());
  c.v = rows_of<const T*>(v, v.data_ptr<T>());
  c.off = off.data_ptr<int64_t>();
  c.visits = visits.data_ptr<int64_t>();
  c.nqb = off.size(0) - 1;
  // Every buffer is sized by the blocks: a visit larger than them would write past its end.
  TORCH_CHECK(visits.is_contiguous() && off.is_contiguous(), "contiguous plan");
  for (int64_t vi = 0; vi < visits.size(0); ++vi) {
    const int64_t* vis = c.visits + vi * 6;
    TORCH_CHECK(0 <= vis[0] && vis[0] <= vis[1] && vis[1] - vis[0] <= block_k && vis[1] <= c.Tk &&
                    0 <= vis[2] && vis[2] <= vis[3] && vis[3] <= block_q,
                "attnkit internal error: a visit outside its block");
  }
  c.scale = scale;
  c.softcap = softcap;
  if (bias.has_value() && layout.empty()) {
    c.bias = bias->data_ptr<T>();
    for (int d = 0; d < 5; ++d) c.bs[d] = bias->size(d) == 1 ? 0 : bias->stride(d);
  } else if (bias.has_value()) {
    // (strides of n, hk, g, i, j, then the base): every element read lies in the tensor.
    TORCH_CHECK(layout.size() == 6 && bias->is_contiguous(), "a bias layout is 5 strides, a base");
    const int64_t sizes[5] = {c.N, c.Hkv, c.G, c.Tq, c.Tk};
    int64_t lo = layout[5], hi = layout[5];
    for (int d = 0; d < 5; ++d) {
      c.bs[d] = layout[d];
      const int64_t span = layout[d] * std::max<int64_t>(sizes[d] - 1, 0);
      lo += std::min<int64_t>(span, 0);
      hi += std::max<int64_t>(span, 0);
    }
    TORCH_CHECK(sizes[3] * sizes[4] == 0 || (lo >= 0 && hi < bias->numel()),
                "attnkit internal error: a bias layout outside its table");
    c.bias = bias->data_ptr<T>() + layout[5];
    c.bias_aliased = true;
  }
  if (band.size() == 2) {
    c.band = true;
    c.lo = band[0];
    c.hi = band[1];
    c.shift = shift;
  }
  if (key_ok.has_value()) {
    c.key_ok = key_ok->data_ptr<uint8_t>();
    c.key_rows = key_ok->size(0);
  }
  if (tiles.has_value()) {
    c.tiles = tiles->data_ptr<uint8_t>();
    c.tile_n = tiles->size(1);
    c.tile_h = tiles->size(2);
  }
  c.p_drop = p_drop;
  c.seed = (uint64_t)seed;
  if (qv.has_value() && enc.has_value()) {
    TORCH_CHECK(enc->dim() == 3 && (enc->stride(2) == 1 || enc->size(2) <= 1),
                "enc's rows must be contiguous");
    TORCH_CHECK(qv->dim() == 4 && qv->size(0) == c.N && qv->size(1) == c.Hkv * c.G &&
                    qv->size(2) == c.Tq && qv->size(3) == enc->size(2),
                "qv is (N, H, Tq, Dh)");
    TORCH_CHECK(enc->size(0) == c.Hkv * c.G, "enc is (H, P, Dh)");
    c.qv = rows_of<const T*>(*qv, qv->data_ptr<T>());
    c.enc = enc->data_ptr<T>();
    c.enc_hs = enc->stride(0);
    c.enc_ld = std::max<int64_t>(enc->stride(1), enc->size(2));
    TORCH_CHECK(enc->size(1) <= 1 || enc->stride(1) >= enc->size(2), "enc's rows must not overlap");
    c.Dh = enc->size(2);
    c.P = enc->size(1);
    c.top = top;
    c.rel_scale = rel_scale;
    c.whole_width = whole_width;
    c.drows = c.P;
  }
  return c;
}

// enc^T for add_skewed and enc row-major for the backward's skewed products (see Call::et and
// Call::ez), or nothing where they do not run: float32 with register tiles and a position term.
// Its columns are the rows of enc the plan's visits read, up to a block's rows and keys beyond
// the table (zeros there); a visit reading further takes the product of its window.
template <typename T>
std::vector<at::Tensor> skew_table(Call<T>& c, const c10::optional<at::Tensor>& enc) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (!use_tiles || !fuse_position || c.qv.p == nullptr) return {};
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
    at::Tensor ez = at::empty({H, panels * W, D}, enc->options());
    at::Tensor et = at::empty({H, panels, D, W}, enc->options());
    float* z = ez.data_ptr<float>();
    float* t = et.data_ptr<float>();
    // One pass per panel: its encodings row-major into ez and transposed into et.
    at::parallel_for(0, H * panels, 16, [&](int64_t begin, int64_t end) {
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

// A (N, Hkv, G, T, d) tensor laid out like q: (N, T, Hkv, G, d) in memory when q's rows are
// token-major (a view of (B, T, H, D), as projections give), so that the caller's transpose back
// is free; else contiguous.
at::Tensor like_q(const at::Tensor& q, int64_t d) {
  const bool token_major = q.size(3) > 1 && q.stride(3) >= q.size(1) * q.size(2) * q.size(4);
  if (!token_major) return at::empty({q.size(0), q.size(1), q.size(2), q.size(3), d}, q.options());
  return at::empty({q.size(0), q.size(3), q.size(1), q.size(2), d}, q.options())
      .permute({0, 2, 3, 1, 4});
}

// acc += x * 0 over n elements from p: x * 0 is 0 for a finite x, NaN for inf or NaN.
template <typename T>
void add_zeros(const T* p, int64_t n, at::vec::Vectorized<T> (&acc)[4], T& tail) {
  using V = at::vec::Vectorized<T>;
  const V zero(T(0));
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    for (int u = 0; u < 4; ++u) acc[u] = at::vec::fmadd(V::loadu(p + j + u * W), zero, acc[u]);
  }
  for (; j + W <= n; j += W) acc[0] = at::vec::fmadd(V::loadu(p + j), zero, acc[0]);
  for (; j < n; ++j) tail += p[j] * T(0);
}

template <typename T>
bool all_zero(at::vec::Vectorized<T> (&acc)[4], T tail) {
  using V = at::vec::Vectorized<T>;
  const V sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  return at::vec::vec_reduce_all<T>([](V& a, V& b) { return a + b; }, sum) + tail == T(0);
}

// One tensor as stretches: its dimensions by decreasing stride, size-1 ones dropped and
// neighbours that are one run of memory merged; each stretch is a run of the innermost dimension
// (or one element, when that is not contiguous), cut into pieces of at most kPiece elements.
struct Stretches {
  static constexpr int64_t kPiece = 16384;
  const char* base = nullptr;
  bool dbl = false;
  std::vector<int64_t> size, stride;  // the outer dimensions
  int64_t len = 1, pieces = 1, count = 1;

  explicit Stretches(const at::Tensor& t) : base(static_cast<const char*>(t.data_ptr())) {
    dbl = t.scalar_type() == at::kDouble;
    // Neither the order of the elements nor their repeats matter: dimensions by decreasing
    // stride, broadcast ones dropped.
    std::vector<int64_t> order;
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) != 1 && t.stride(d) != 0) order.push_back(d);  // stride 0: repeats
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
    std::vector<int64_t> sz, st;
    for (int64_t d : order) {
      if (!sz.empty() && st.back() == t.stride(d) * t.size(d)) {
        sz.back() *= t.size(d);
        st.back() = t.stride(d);
      } else {
        sz.push_back(t.size(d));
        st.push_back(t.stride(d));
      }
    }
    if (!sz.empty() && st.back() == 1) {
      len = sz.back();
      sz.pop_back();
      st.pop_back();
    }
    size = sz;
    stride = st;
    pieces = (len + kPiece - 1) / kPiece;
    for (int64_t x : size) count *= x;
    count *= pieces;
  }

  // Pieces u0:u1 are finite.
  bool finite(int64_t u0, int64_t u1) const {
    return dbl ? finite_as<double>(u0, u1) : finite_as<float>(u0, u1);
  }

  template <typename T>
  bool finite_as(int64_t u0, int64_t u1) const {
    const int64_t dims = (int64_t)size.size();
    std::vector<int64_t> idx(dims, 0);
    int64_t row = u0 / pieces, piece = u0 % pieces, off = 0;
    for (int64_t d = dims - 1; d >= 0; --d) {
      idx[d] = row % size[d];
      row /= size[d];
      off += idx[d] * stride[d];
    }
    const T* p = reinterpret_cast<const T*>(base);
    at::vec::Vectorized<T> acc[4] = {T(0), T(0), T(0), T(0)};
    T tail = 0;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t a = piece * kPiece;
      add_zeros(p + off + a, std::min(kPiece, len - a), acc, tail);
      if (++piece == pieces) {  // the next row: an odometer over the outer dimensions
        piece = 0;
        for (int64_t d = dims - 1; d >= 0; --d) {
          off += stride[d];
          if (++idx[d] < size[d]) break;
          off -= stride[d] * size[d];
          idx[d] = 0;
        }
      }
    }
    return all_zero(acc, tail);
  }
};

// Whether every element of these float32/float64 tensors is finite: one read of each, in one
// parallel region (a sum would take a pass per tensor, and overflow past 1e38).
bool all_finite(std::vector<at::Tensor> ts) {
  std::vector<Stretches> parts;
  std::vector<int64_t> first = {0};
  for (const auto& t : ts) {
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
                "all_finite: float32 or float64 tensors");
    if (t.numel() == 0) continue;
    parts.emplace_back(t);
    first.push_back(first.back() + parts.back().count);
  }
  std::atomic<bool> ok{true};
  at::parallel_for(0, first.back(), 8, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < parts.size() && ok.load(std::memory_order_relaxed); ++i) {
      const int64_t a = std::max(begin, first[i]), b = std::min(end, first[i + 1]);
      if (a < b && !parts[i].finite(a - first[i], b - first[i])) ok = false;
    }
  });
  return ok.load();
}

// A (N, Hkv, T, D) tensor like k or v: token-major when it is, else contiguous.
at::Tensor like_kv(const at::Tensor& k) {
  const bool token_major = k.size(2) > 1 && k.stride(2) >= k.size(1) * k.size(3);
  if (!token_major) return at::empty(k.sizes(), k.options());
  return at::empty({k.size(0), k.size(2), k.size(1), k.size(3)}, k.options()).permute({0, 2, 1, 3});
}

std::vector<at::Tensor> forward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor off,
                                at::Tensor visits, int64_t block_q, int64_t block_k, double scale,
                                double softcap, c10::optional<at::Tensor> bias,
                                std::vector<int64_t> layout, std::vector<double> band,
                                int64_t shift, c10::optional<at::Tensor> key_ok,
                                c10::optional<at::Tensor> tiles,
                                double p_drop, int64_t seed, c10::optional<at::Tensor> qv,
                                c10::optional<at::Tensor> enc, double rel_scale, int64_t top,
                                int64_t whole_width) {
  TORCH_CHECK(q.dim() == 5 && k.dim() == 4 && v.dim() == 4, "q (N, Hkv, G, Tq, D), k, v 4-d");
  auto out = like_q(q, v.size(3));
  auto lse = at::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnkit_native_forward", [&] {
    auto c = make_call<scalar_t>(q, k, v, off, visits, block_q, block_k, scale, softcap, bias,
                                 layout, band, shift, key_ok, tiles, p_drop, seed, qv, enc,
                                 rel_scale, top, whole_width);
    const auto tables = skew_table(c, enc);
    forward_impl<scalar_t>(c, rows_of<scalar_t*>(out, out.data_ptr<scalar_t>()),
                           lse.data_ptr<scalar_t>());
  });
  return {out, lse};
}

std::vector<at::Tensor> backward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor off,
                                 at::Tensor visits, int64_t block_q, int64_t block_k,
                                 double scale, double softcap, c10::optional<at::Tensor> bias,
                                 std::vector<int64_t> layout, std::vector<double> band,
                                 int64_t shift,
                                 c10::optional<at::Tensor> key_ok,
                                 c10::optional<at::Tensor> tiles, double p_drop, int64_t seed,
                                 c10::optional<at::Tensor> qv, c10::optional<at::Tensor> enc,
                                 double rel_scale, int64_t top, int64_t whole_width,
                                 at::Tensor dout, at::Tensor lse,
                                 at::Tensor delta, bool bias_grad, bool qv_grad, bool enc_grad,
                                 std::vector<at::Tensor> grads_out) {
  TORCH_CHECK(lse.is_contiguous() && delta.is_contiguous(), "contiguous lse, delta");
  // dq, dk, dv: where the caller gives them (q's, k's and v's own shapes and dtype, rows
  // contiguous), else laid out as the inputs are (token-major or contiguous), so that the
  // caller's transpose back is free. The kernel writes every element.
  at::Tensor dq, dk, dv;
  if (grads_out.empty()) {
    dq = like_q(q, q.size(4));
    dk = like_kv(k);
    dv = like_kv(v);
  } else {
    TORCH_CHECK(grads_out.size() == 3, "grads_out: dq, dk, dv");
    dq = grads_out[0];
    dk = grads_out[1];
    dv = grads_out[2];
    const at::Tensor* like[3] = {&q, &k, &v};
    for (int x = 0; x < 3; ++x) {
      TORCH_CHECK(grads_out[x].sizes() == like[x]->sizes() &&
                      grads_out[x].scalar_type() == like[x]->scalar_type(),
                  "grads_out: the inputs' shapes and dtype");
    }
  }
  at::Tensor dbias;
  int64_t ds[5] = {0, 0, 0, 0, 0};
  int64_t dbias_base = 0;
  if (bias_grad) {
    TORCH_CHECK(bias.has_value() && (bias->dim() == 5 || !layout.empty()),
                "bias_grad without a 5-d bias or a layout");
    dbias = at::zeros(bias->sizes(), q.options());  // the bias's shape, not (N, Hkv, G, Tq, Tk)
    if (layout.empty()) {
      for (int d = 0; d < 5; ++d) ds[d] = dbias.size(d) == 1 ? 0 : dbias.stride(d);
    } else {
      for (int d = 0; d < 5; ++d) ds[d] = layout[d];
      dbias_base = layout[5];
    }
  }
  const bool position = qv.has_value() && enc.has_value();
  at::Tensor dqv, denc;
  // dqv laid out as qv (token-major or contiguous; backward_impl writes every row), denc as enc,
  // so that the caller's transposes back are free.
  if (position && qv_grad) dqv = like_kv(*qv);
  if (position && enc_grad) denc = at::zeros_like(*enc);  // enc's layout where it is dense
  int64_t dhs[2] = {0, 0};
  if (denc.defined()) dhs[0] = denc.stride(0), dhs[1] = denc.stride(1);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnkit_native_backward", [&] {
    auto c = make_call<scalar_t>(q, k, v, off, visits, block_q, block_k, scale, softcap, bias,
                                 layout, band, shift, key_ok, tiles, p_drop, seed, qv, enc,
                                 rel_scale, top, whole_width);
    const auto tables = skew_table(c, enc);
    backward_impl<scalar_t>(c, rows_of<const scalar_t*>(dout, dout.data_ptr<scalar_t>()),
                            lse.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                            rows_of<scalar_t*>(dq, dq.data_ptr<scalar_t>()),
                            rows_of<scalar_t*>(dk, dk.data_ptr<scalar_t>()),
                            rows_of<scalar_t*>(dv, dv.data_ptr<scalar_t>()),
                            bias_grad ? dbias.data_ptr<scalar_t>() : nullptr, ds,
                            bias_grad ? dbias.numel() : 0, dbias_base,
                            dqv.defined() ? rows_of<scalar_t*>(dqv, dqv.data_ptr<scalar_t>())
                                          : Rows<scalar_t*>(),
                            denc.defined() ? denc.data_ptr<scalar_t>() : nullptr, dhs);
  });
  // Undefined tensors (gradients not asked for) reach Python as None.
  return {dq, dk, dv, dbias, dqv, denc};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "attention forward: (out, lse)");
  m.def("all_finite", &all_finite, "whether every element of the tensors is finite");
  m.def(
      "use_tiles", [](bool on) { return switch_to(use_tiles, on); },
      "float32 products with a row-major right operand in the kernel's own register tiles (true) "
      "or the BLAS; returns the previous setting (always false where the build has no AVX-512)");
  m.def(
      "fuse_position", [](bool on) { return switch_to(fuse_position, on); },
      "float32 position terms and their gradients as register-tile products along the scores' "
      "diagonals (true) or as products against each block's window of distances; returns the "
      "previous setting (always false where the build has no AVX-512)");
  m.def("backward", &backward, "attention backward: (dq, dk, dv, dbias, dqv, denc), None where not asked");
}
