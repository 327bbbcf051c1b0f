// Products in the kernel's own AVX-512 register tiles, and the GEMM that chooses between them and
// the BLAS torch links.
#pragma once

#include "common.h"

namespace attnkit {
// Internal linkage, as in one translation unit: each .cpp gets its own copy of these helpers,
// which the compiler then inlines and specialises freely (their hot loops depend on it).
namespace {

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
inline void tile(int64_t k, float alpha, const float* a, int64_t sai, int64_t sak, const float* b,
                 int64_t ldb, int64_t vs, float beta, float* c, int64_t ldc, int64_t tail) {
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
inline void tile_rows(int64_t m, int64_t k, float alpha, const float* a, int64_t sai, int64_t sak,
                      const float* b, int64_t ldb, int64_t vs, float beta, float* c, int64_t ldc,
                      int64_t tail) {
  constexpr int R = 6;
  int64_t i = 0;
  for (; i + R <= m; i += R)
    tile<R, NV>(k, alpha, a + i * sai, sai, sak, b, ldb, vs, beta, c + i * ldc, ldc, tail);
  const float* ai = a + i * sai;
  float* ci = c + i * ldc;
  switch (m - i) {
    case 5:
      tile<5, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail);
      break;
    case 4:
      tile<4, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail);
      break;
    case 3:
      tile<3, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail);
      break;
    case 2:
      tile<2, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail);
      break;
    case 1:
      tile<1, NV>(k, alpha, ai, sai, sak, b, ldb, vs, beta, ci, ldc, tail);
      break;
    default:
      break;
  }
}

// C (m x n) = alpha * A B + beta * C in stretches of columns: 4 vectors, then 1, then a masked
// rest. Column j of B starts at b + j * step (1 for a row-major B; the width for panels), its
// vector v at + v * vs and its row p at + p * ldb.
inline void columns(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t sai,
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
inline void tiled(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t sai,
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

// K^T for the keys [k0, k1) of one head (k: key k0's row), in panels of W keys: panel i holds keys k0 + W i ...,
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
      at::vec::transpose_mxn<float>(k + i * W * ld, ld, dst, W, int(keys), int(D));
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
#else
struct KeyPanels {
  bool ready = false;
  bool holds(int64_t, int64_t) const { return false; }
  void scores(int64_t, int64_t, int64_t, float, const float*, int64_t, float*, int64_t) const {}
};
#endif

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, op(A) m x k, op(B) k x n. A column-major
// BLAS computes C^T = op(B)^T op(A)^T: the operands swap, their flags stay. tiles: float32
// products with a row-major right operand run in register tiles (where the build has AVX-512).
template <typename T>
void gemm([[maybe_unused]] bool tiles, bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha,
          const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // empty products (a head size of 0): a BLAS refuses the leading dimensions of 0
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
    return;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (tiles && !tb) {
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
// ldx from x (key ks's row): from the query block's panels of x when they hold those keys, else by
// the BLAS.
template <typename T>
void times_keys(bool tiles, const KeyPanels* panels, int64_t rows, int64_t ks, int64_t ke,
                int64_t width, T alpha, const T* a, int64_t lda, const T* x, int64_t ldx, T* out,
                int64_t ld) {
  if constexpr (std::is_same_v<T, float>) {
    if (panels != nullptr && panels->holds(ks, ke)) {
      panels->scores(rows, ks, ke, alpha, a, lda, out, ld);
      return;
    }
  }
  gemm<T>(tiles, false, true, rows, ke - ks, width, alpha, a, lda, x, ldx, T(0), out, ld);
}

}  // namespace
}  // namespace attnkit
