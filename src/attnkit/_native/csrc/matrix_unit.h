// bfloat16 products on the CPU's matrix unit (AMX), through the batch-reduce GEMM torch links
// (oneDNN's micro-kernels, at::native::cpublas::brgemm): where the CPU has one, the forward of
// bfloat16 queries, keys and values takes q k^T and p v as bfloat16 products summed in float32,
// many times the rate of float32 vector FMAs, while the softmax stays in float32 between them.
//
// The matrix unit reads its right operand as pairs of bfloat16 along the sum ("VNNI" layout:
// element (p, j) of a K x N matrix at [p / 2][j][p % 2]). For q k^T the sum runs over the head's
// width, so a pair is two neighbouring elements of a key row, one 32-bit word, and the packed K^T
// is a transpose of the keys' words; for p v it runs over the keys, so a pair interleaves two
// neighbouring rows of v. Both are made once per call, for every key, before the query blocks
// read them (PackedKeys): as many bytes as the keys and values themselves.
#pragma once

#include <optional>

#include "common.h"

#if __has_include(<ATen/native/CPUBlas.h>)
#include <ATen/native/CPUBlas.h>
#endif

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

#if defined(CPU_CAPABILITY_AVX512) && defined(CPUBLAS_BRGEMM_BF16BF16F32)
#define ATTNKIT_MATRIX_UNIT 1

// Whether this CPU multiplies bfloat16 on a matrix unit that torch's GEMM drives (AMX-BF16).
inline bool has_matrix_unit() {
  static const bool yes = at::native::cpublas::could_pack(at::kBFloat16);
  return yes;
}

// C (m x n, ldc) = (add ? C : 0) + A B, A bfloat16 (m x k, lda), B packed (see above) with ldb
// columns per pair of rows, k even.
inline void bf16_product(int64_t m, int64_t n, int64_t k, const at::BFloat16* a, int64_t lda,
                         const at::BFloat16* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, /*is_vnni=*/true);
}

// The matrix unit's state (tile configuration) is per thread: a parallel region's thread hands it
// back when it leaves the region.
struct MatrixUnitThread {
  bool used = false;
  ~MatrixUnitThread() {
    if (used) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  }
};

// Every key and value of a call, packed for the matrix unit: per (n, hk), K^T as Dk / 2 rows of
// `ldk` words (word j of row w: key j's elements 2w, 2w + 1), and v as (Tk + 1) / 2 rows of Dv
// pairs (pair d of row i: v[2i][d], v[2i + 1][d]; a missing last key 0). ldk is the keys rounded
// up to 32, plus 16 when that is a multiple of 1,024 words: rows 4 KiB apart would share L1's
// sets.
struct PackedKeys {
  int64_t Hkv = 0, Dk = 0, Dv = 0, Tk = 0, ldk = 0, rows_v = 0;
  at::Tensor k, v;  // int32 (N, Hkv, Dk / 2, ldk), bfloat16 (N, Hkv, rows_v, Dv, 2)

  // Whether keys of this width and layout can be packed (whole 32-bit words per row).
  static bool fits(const Rows<const at::BFloat16*>& k, int64_t Dk) {
    return Dk > 0 && Dk % 2 == 0 && k.ld() % 2 == 0 &&
           reinterpret_cast<uintptr_t>(k.p) % alignof(uint32_t) == 0;
  }

  PackedKeys(const Rows<const at::BFloat16*>& kr, const Rows<const at::BFloat16*>& vr, int64_t N,
             int64_t Hkv_, int64_t Tk_, int64_t Dk_, int64_t Dv_)
      : Hkv(Hkv_), Dk(Dk_), Dv(Dv_), Tk(Tk_) {
    ldk = (Tk + 31) / 32 * 32;
    if (ldk % 1024 == 0) ldk += 16;
    rows_v = (Tk + 1) / 2;
    k = at::empty({N, Hkv, Dk / 2, ldk}, at::kInt);
    v = at::empty({N, Hkv, rows_v, Dv, 2}, at::kBFloat16);
    // Stretches of 64 keys of one head, shared by the threads.
    constexpr int64_t kStretch = 64;
    const int64_t stretches = (Tk + kStretch - 1) / kStretch, items = N * Hkv * stretches;
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t nh = item / stretches, j0 = item % stretches * kStretch;
        const int64_t n = nh / Hkv, hk = nh % Hkv, j1 = std::min(Tk, j0 + kStretch);
        pack_k(kr, n, hk, j0, j1);
        pack_v(vr, n, hk, j0, j1);
      }
    });
  }

  // K^T's rows for head (n, hk): the first of Dk / 2, ldk words apart.
  const at::BFloat16* keys(int64_t n, int64_t hk) const {
    return reinterpret_cast<const at::BFloat16*>(k.data_ptr<int32_t>() +
                                                 (n * Hkv + hk) * (Dk / 2) * ldk);
  }
  // v's pair rows for head (n, hk), from the pair holding key 2i.
  const at::BFloat16* values(int64_t n, int64_t hk, int64_t i) const {
    return v.data_ptr<at::BFloat16>() + ((n * Hkv + hk) * rows_v + i) * Dv * 2;
  }

 private:
  void pack_k(const Rows<const at::BFloat16*>& kr, int64_t n, int64_t hk, int64_t j0,
              int64_t j1) {
    // A transpose of 32-bit words; transpose_mxn<float> only moves their bits.
    const float* src = reinterpret_cast<const float*>(kr.at(n, hk, 0, j0));
    float* dst = reinterpret_cast<float*>(k.data_ptr<int32_t>()) +
                 (n * Hkv + hk) * (Dk / 2) * ldk + j0;
    at::vec::transpose_mxn<float>(src, kr.ld() / 2, dst, ldk, int(j1 - j0), int(Dk / 2));
    if (j1 == Tk) {  // the columns past the last key: zeros
      for (int64_t w = 0; w < Dk / 2; ++w)
        std::fill(dst + w * ldk + (j1 - j0), dst + w * ldk + (ldk - j0), 0.f);
    }
  }

  void pack_v(const Rows<const at::BFloat16*>& vr, int64_t n, int64_t hk, int64_t j0,
              int64_t j1) {
    // j0 is even (stretches of 64 keys): pairs (j0, j0 + 1), ...
    for (int64_t j = j0; j < j1; j += 2) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(vr.at(n, hk, 0, j));
      const uint16_t* b =
          j + 1 < Tk ? reinterpret_cast<const uint16_t*>(vr.at(n, hk, 0, j + 1)) : nullptr;
      uint32_t* out = reinterpret_cast<uint32_t*>(const_cast<at::BFloat16*>(values(n, hk, j / 2)));
      int64_t d = 0;
      for (; b != nullptr && d + 16 <= Dv; d += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + d)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + d)));
        _mm512_storeu_si512(out + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
      for (; d < Dv; ++d) out[d] = uint32_t(a[d]) | (b == nullptr ? 0u : uint32_t(b[d]) << 16);
    }
  }
};

// Rows of float32 as bfloat16 (nearest even), and whether every one was exact: the forward takes
// q in float32, and runs q k^T on the matrix unit only for queries that are bfloat16 values.
inline bool to_bf16_exact(const float* x, int64_t n, at::BFloat16* out) {
  at::vec::convert(x, out, n);
  int64_t e = 0;
  __mmask16 differ = 0;
  for (; e + 16 <= n; e += 16) {
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(out + e))), 16));
    differ |= _mm512_cmp_ps_mask(back, _mm512_loadu_ps(x + e), _CMP_NEQ_UQ);
  }
  bool exact = differ == 0;
  for (; e < n; ++e) exact = exact && float(out[e]) == x[e];
  return exact;
}
#else
inline bool has_matrix_unit() { return false; }
#endif

}  // namespace
}  // namespace attnkit
