// bfloat16 products on the CPU's matrix unit (AMX): where the CPU has one, the forward of bfloat16
// queries, keys and values takes q k^T and p v as bfloat16 products summed in float32, many times
// the rate of float32 vector FMAs, while the softmax stays in float32 between them; so does the
// backward with its five. The forward runs them in the unit's tiles itself where the heads'
// widths allow (tile_scores, tile_values), else, as the backward does, through the batch-reduce
// GEMM torch links (oneDNN's micro-kernels, at::native::cpublas::brgemm). A CPU without the unit
// but with AVX512-BF16 runs the same products, on the same packed operands, as that extension's
// dot products in vector registers (dot_product).
//
// The matrix unit reads its right operand as pairs of bfloat16 along the sum ("VNNI" layout:
// element (p, j) of a K x N matrix at [p / 2][j][p % 2]). For q k^T the sum runs over the head's
// width, so a pair is two neighbouring elements of a key row, one 32-bit word, and the packed K^T
// is a transpose of the keys' words; for p v it runs over the keys, so a pair interleaves two
// neighbouring rows of v. Both are made once per call, for every key, before the query blocks
// read them (PackedRows): as many bytes as the keys and values themselves.
#pragma once

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#define ATTNKIT_CPUID 1
#endif

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "common.h"

#if __has_include(<ATen/native/CPUBlas.h>)
#include <ATen/native/CPUBlas.h>
#endif
// The tiles' own code (tile_scores, tile_values) needs a compiler that knows AMX (GCC 11 and
// clang 12 on) and Linux's permission request; elsewhere the forward keeps torch's GEMM.
#if defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : (defined(__GNUC__) && __GNUC__ >= 11))
#define ATTNKIT_TILE_CODE 1
#include <sys/syscall.h>
#include <unistd.h>
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

// Whether this CPU has AVX512-BF16 (vdpbf16ps: each float32 lane += the sum of two bfloat16
// products, twice float32 FMA's multiply-adds per instruction): CPUs without the matrix unit
// (AMD's Zen 4 and later, Intel's Cooper Lake) run the products there instead (dot_product).
inline bool has_bf16_dot() {
  // CPUID leaf 7, subleaf 1: EAX bit 5 (the kernel runs AVX-512 code only where the OS keeps its
  // registers, so that needs no second check)
  static const bool yes = [] {
#if defined(ATTNKIT_CPUID)
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a >> 5 & 1u) != 0;
#else
    return false;
#endif
  }();
  return yes;
}

// Whether the bfloat16 products run natively here: on the matrix unit or on AVX512-BF16.
inline bool has_bf16_products() { return has_matrix_unit() || has_bf16_dot(); }

// Whether AVX512-BF16's dot products outrun float32 FMAs on rows converted to float32, where a
// product's operands are read from L1 anyway (the decode path's grouped steps, decode_group.h).
// AMD's cores (Zen 4 on) issue a 512-bit vdpbf16ps, 32 multiply-adds, at the rate of a 512-bit
// FMA, 16; Intel's without the matrix unit issue it at half their FMAs' rate, no faster than the
// FMAs. $ATTNKIT_BF16_DOTS ("always" or "never"; "auto", the default, as above) fixes the
// choice; "always" still needs AVX512-BF16.
inline bool bf16_dots_outrun_fma() {
  static const bool yes = [] {
    if (!has_bf16_dot()) return false;
    const char* text = std::getenv("ATTNKIT_BF16_DOTS");
    std::string word = text == nullptr ? "" : text;
    // As attnkit reads it (which warns of a misspelling): any case, spaces around.
    word.erase(0, word.find_first_not_of(" \t\r\n"));
    word.erase(word.find_last_not_of(" \t\r\n") + 1);
    for (char& ch : word) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    if (word == "always" || word == "never") return word == "always";
#if defined(ATTNKIT_CPUID)
    unsigned a = 0, b = 0, c = 0, d = 0;
    // CPUID leaf 0: the vendor's name in EBX, EDX, ECX ("Auth", "enti", "cAMD")
    return __get_cpuid(0, &a, &b, &c, &d) != 0 && b == 0x68747541u && d == 0x69746e65u &&
           c == 0x444d4163u;
#else
    return false;
#endif
  }();
  return yes;
}

#define ATTNKIT_BF16 __attribute__((target("avx512bf16")))
ATTNKIT_BF16 inline void dot_product(int64_t m, int64_t n, int64_t k, const at::BFloat16* a,
                                     int64_t lda, const at::BFloat16* b, int64_t ldb, float* c,
                                     int64_t ldc, bool add);

// C (m x n, ldc) = (add ? C : 0) + A B, A bfloat16 (m x k, lda), B packed (see above) with ldb
// columns per pair of rows, k even: on the matrix unit, else on AVX512-BF16.
inline void bf16_product(int64_t m, int64_t n, int64_t k, const at::BFloat16* a, int64_t lda,
                         const at::BFloat16* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  if (has_matrix_unit()) {
    at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, /*is_vnni=*/true);
  } else {
    dot_product(m, n, k, a, lda, b, ldb, c, ldc, add);
  }
}

// The matrix unit's state (tile configuration) is per thread: a parallel region's thread hands it
// back when it leaves the region.
struct MatrixUnitThread {
  bool used = false;
  ~MatrixUnitThread() {
    if (used && has_matrix_unit()) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  }
};

// Every row of every head of a (N, H, T, D) bfloat16 tensor (keys, values), packed once per call
// for the matrix unit as the right operand of a product summed over D ("words": X^T as D / 2 rows
// of `ld` words, word j of row w holding row j's elements 2w, 2w + 1; for q k^T) or over T
// ("pairs": X as (T + 1) / 2 rows of D pairs, pair d of row i holding rows 2i, 2i + 1's element d,
// a missing last row 0; for p v). ld is T rounded up to 32, plus 16 when that is a multiple of
// 1,024 words: rows 4 KiB apart would share L1's sets.
struct PackedRows {
  bool words = true;
  int64_t H = 0, T = 0, D = 0, ld = 0, per_head = 0;  // per_head: bfloat16 elements per head
  at::Tensor buf;
  int64_t N = 0;
  Rows<const at::BFloat16*> x;  // the rows to pack (read by pack_all only)

  // Whether rows of this width and layout can be packed as words (whole 32-bit words per row).
  static bool fits(const Rows<const at::BFloat16*>& x, int64_t D) {
    return D > 0 && D % 2 == 0 && x.ld() % 2 == 0 &&
           reinterpret_cast<uintptr_t>(x.p) % alignof(uint32_t) == 0;
  }

  // The buffer for x's rows, packed by pack_all.
  PackedRows(const Rows<const at::BFloat16*>& x_, int64_t N_, int64_t H_, int64_t T_, int64_t D_,
             bool words_)
      : words(words_), H(H_), T(T_), D(D_), N(N_), x(x_) {
    ld = (T + 31) / 32 * 32;
    if (ld % 1024 == 0) ld += 16;
    // (pairs: 16 rows of zeros after the last, which products over 32 keys at a time may read;
    // words: 32 more columns after the last head's, read as the same)
    per_head = words ? D * ld : ((T + 1) / 2 + 16) * D * 2;
    buf = empty({N * H * per_head + 64}, at::kBFloat16);
    buf.narrow(0, N * H * per_head, 64).zero_();
  }

  // Packs every row of each of these, in one parallel region (on a busy machine each region's
  // end waits for its slowest thread): stretches of 64 rows of one head, claimed one at a time.
  static void pack_all(std::initializer_list<PackedRows*> all) {
    constexpr int64_t kStretch = 64;
    std::vector<std::pair<PackedRows*, int64_t>> first;  // each pack's first item
    int64_t items = 0;
    for (PackedRows* p : all) {
      first.emplace_back(p, items);
      items += p->N * p->H * ((p->T + kStretch - 1) / kStretch);
    }
    std::atomic<int64_t> next{0};
    parallel(0, items, 1, [&](int64_t, int64_t) {
      for (int64_t item = claim(next); item < items; item = claim(next)) {
        size_t i = first.size() - 1;
        while (first[i].second > item) --i;
        PackedRows& p = *first[i].first;
        const int64_t stretches = (p.T + kStretch - 1) / kStretch, local = item - first[i].second;
        const int64_t nh = local / stretches, j0 = local % stretches * kStretch;
        const int64_t n = nh / p.H, h = nh % p.H, j1 = std::min(p.T, j0 + kStretch);
        if (p.words) {
          p.pack_words(p.x, n, h, j0, j1);
        } else {
          p.pack_pairs(p.x, n, h, j0, j1);
        }
      }
    });
  }

  // Head (n, h)'s packed rows: words, column j at + 2 j; pairs, pair row i at + i * 2 D.
  const at::BFloat16* head(int64_t n, int64_t h) const {
    return buf.data_ptr<at::BFloat16>() + (n * H + h) * per_head;
  }

 private:
  at::BFloat16* mutable_head(int64_t n, int64_t h) {
    return buf.data_ptr<at::BFloat16>() + (n * H + h) * per_head;
  }

  void pack_words(const Rows<const at::BFloat16*>& x, int64_t n, int64_t h, int64_t j0,
                  int64_t j1) {
    // A transpose of 32-bit words; transpose_mxn<float> only moves their bits.
    const float* src = reinterpret_cast<const float*>(x.at(n, h, 0, j0));
    float* dst = reinterpret_cast<float*>(mutable_head(n, h)) + j0;
    at::vec::transpose_mxn<float>(src, x.ld() / 2, dst, ld, int(j1 - j0), int(D / 2));
    if (j1 == T) {  // the columns past the last row: zeros
      for (int64_t w = 0; w < D / 2; ++w)
        std::fill(dst + w * ld + (j1 - j0), dst + w * ld + (ld - j0), 0.f);
    }
  }

  void pack_pairs(const Rows<const at::BFloat16*>& x, int64_t n, int64_t h, int64_t j0,
                  int64_t j1) {
    // j0 is even (stretches of 64 rows): pairs (j0, j0 + 1), ...
    for (int64_t j = j0; j < j1; j += 2) {
      const at::BFloat16* a = x.at(n, h, 0, j);
      const at::BFloat16* b = j + 1 < T ? x.at(n, h, 0, j + 1) : nullptr;
      interleave(a, b, D, mutable_head(n, h) + j * D);
    }
    if (j1 == T) {  // the rows of zeros after the last pair
      at::BFloat16* head = mutable_head(n, h);
      std::fill(head + (T + 1) / 2 * D * 2, head + per_head, at::BFloat16(0.f));
    }
  }

 public:
  // Rows a and b (b null: zeros) of width d as d pairs at out.
  static void interleave(const at::BFloat16* a, const at::BFloat16* b, int64_t d,
                         at::BFloat16* out) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(a);
    const uint16_t* y = reinterpret_cast<const uint16_t*>(b);
    uint32_t* o = reinterpret_cast<uint32_t*>(out);
    int64_t e = 0;
    for (; y != nullptr && e + 16 <= d; e += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + e)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(y + e)));
      _mm512_storeu_si512(o + e, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; e < d; ++e) o[e] = uint32_t(x[e]) | (y == nullptr ? 0u : uint32_t(y[e]) << 16);
  }
};

// 2^x to 2.4e-7 relative: x = n + f with |f| <= 1/2, 2^f by a degree-5 polynomial fitted for the
// least largest relative error on [-1/2, 1/2] (8e-8, the rest float32's rounding), times 2^n by
// scalef; 0 from x = -160 down (2^-inf too), NaN for NaN. Enough for probabilities rounded to
// bfloat16 next, at a third of a correctly rounded exp2's cost.
inline __m512 exp2_fast(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-160.f), x);  // max returns its second operand for a NaN
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.327635818290165e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67550283207261e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713266288056e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402212046361542f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931469673151989f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000714970636f));
  return _mm512_scalef_ps(p, n);
}

// The products of the forward's visits in the matrix unit's tiles directly, where the heads'
// widths are multiples of 32 (as most are): every tile 16 rows of 64 bytes, configured once per
// query block, each product 32 x 32 at a time (two tiles of 16 rows of the left operand, two of
// the right, four sums: one load per multiply-add of tiles). Padded operands keep every load in
// bounds: the queries and probabilities come with 32 rows of zeros after the visit's, the keys
// and values with 32 more (PackedRows), so no product needs a shape of its own.
#if defined(ATTNKIT_TILE_CODE)
#define ATTNKIT_TILES __attribute__((target("amx-tile,amx-bf16")))

// The tiles' shapes: palette 1, tiles 0-7 of 16 rows x 64 bytes.
struct alignas(64) TileShapes {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileShapes() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// Whether this process may use the tiles: Linux hands the tile data state to a process that
// asks for it (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as torch's GEMM does.
inline bool tiles_ready() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return has_matrix_unit() && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

// The tiles of one thread, configured for the products below while it lives. torch's GEMM
// keeps its own configuration per thread and reloads it only when it believes another is
// loaded: brgemm_release, before and after, tells it that none is (and releases the tiles).
struct OwnTiles {
  ATTNKIT_TILES OwnTiles() {
    static const TileShapes shapes;
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    _tile_loadconfig(&shapes);
  }
  ~OwnTiles() { at::native::cpublas::brgemm_release(/*is_vnni=*/true); }
  OwnTiles(const OwnTiles&) = delete;
  OwnTiles& operator=(const OwnTiles&) = delete;
};

// Sums 0-3 (a 32 x 32 block: rows 0-15 and 16-31, columns 0-15 and 16-31) += a b for 32 rows of
// a (32 bfloat16 each, rows la elements apart) and 32 columns of b (16 rows of pairs, rows lb
// elements apart), through tiles 4-7.
ATTNKIT_TILES inline void multiply_2x2(const at::BFloat16* a, int64_t la, const at::BFloat16* b,
                                       int64_t lb) {
  _tile_loadd(4, a, la * 2);
  _tile_loadd(5, a + 16 * la, la * 2);
  _tile_loadd(6, b, lb * 2);
  _tile_loadd(7, b + 32, lb * 2);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// Sums 0-3 into a 32 x 32 block of floats, rows ld apart.
ATTNKIT_TILES inline void store_2x2(float* o, int64_t ld) {
  _tile_stored(0, o, ld * 4);
  _tile_stored(1, o + 16, ld * 4);
  _tile_stored(2, o + 16 * ld, ld * 4);
  _tile_stored(3, o + 16 * ld + 16, ld * 4);
}

// s = q k^T for nr queries (rows lq apart, 32 readable past nr) and nk keys (packed words, kt
// at the first key's column, ldk words per row), D a multiple of 32: round32(nr) rows of
// round32(nk) scores, ls (>= that) apart; the rows and columns past nr and nk hold nothing of use.
// Loads and stores of tiles cost several multiply-adds of them (about 15 ns against 5 on an
// Intel Xeon with AMX): heads of width 64 or less keep 32 queries in four tiles and read each
// 16 keys' tiles once for two sums (half the loads of the 32 x 32 products).
ATTNKIT_TILES inline void tile_scores(const at::BFloat16* q, int64_t lq, int64_t nr,
                                      const at::BFloat16* kt, int64_t ldk, int64_t nk, int64_t D,
                                      float* s, int64_t ls) {
  if (D <= 64) {
    for (int64_t i = 0; i < nr; i += 32) {
      _tile_loadd(4, q + i * lq, lq * 2);
      _tile_loadd(5, q + (i + 16) * lq, lq * 2);
      if (D == 64) {
        _tile_loadd(2, q + i * lq + 32, lq * 2);
        _tile_loadd(3, q + (i + 16) * lq + 32, lq * 2);
      }
      for (int64_t j = 0; j < nk; j += 16) {
        _tile_zero(0);
        _tile_zero(1);
        const at::BFloat16* b = kt + j * 2;
        _tile_loadd(6, b, ldk * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (D == 64) {
          _tile_loadd(7, b + 16 * ldk * 2, ldk * 4);
          _tile_dpbf16ps(0, 2, 7);
          _tile_dpbf16ps(1, 3, 7);
        }
        _tile_stored(0, s + i * ls + j, ls * 4);
        _tile_stored(1, s + (i + 16) * ls + j, ls * 4);
      }
    }
    return;
  }
  for (int64_t i = 0; i < nr; i += 32) {
    for (int64_t j = 0; j < nk; j += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t d = 0; d < D; d += 32) {
        multiply_2x2(q + i * lq + d, lq, kt + ((d / 2) * ldk + j) * 2, ldk * 2);
      }
      store_2x2(s + i * ls + j, ls);
    }
  }
}

// acc (rows of Dv floats, 32 writable past nr) += p v for nr rows of kp probabilities (kp a
// multiple of 32, rows kp apart, the 32 rows past nr zeros) and values packed as pairs (v at the
// first key's pair row), Dv a multiple of 32.
ATTNKIT_TILES inline void tile_values(const at::BFloat16* p, int64_t kp, int64_t nr,
                                      const at::BFloat16* v, int64_t Dv, float* acc) {
  for (int64_t i = 0; i < nr; i += 32) {
    for (int64_t jc = 0; jc < Dv; jc += 32) {
      float* o = acc + i * Dv + jc;
      _tile_loadd(0, o, Dv * 4);
      _tile_loadd(1, o + 16, Dv * 4);
      _tile_loadd(2, o + 16 * Dv, Dv * 4);
      _tile_loadd(3, o + 16 * Dv + 16, Dv * 4);
      for (int64_t k = 0; k < kp; k += 32) {
        multiply_2x2(p + i * kp + k, kp, v + (k / 2) * 2 * Dv + jc * 2, 2 * Dv);
      }
      store_2x2(o, Dv);
    }
  }
}

#else
inline bool tiles_ready() { return false; }
struct OwnTiles {};
inline void tile_scores(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t,
                        int64_t, int64_t, float*, int64_t) {}
inline void tile_values(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t,
                        float*) {}
#endif  // ATTNKIT_TILE_CODE

// Every CPU with the matrix unit (AMX-BF16) has AVX512-BF16, whose conversion from float32 to
// bfloat16 (nearest even) is one instruction where at::vec's portable rounding takes seven. The
// functions marked ATTNKIT_BF16 use it, and run only where has_bf16_products() (the rest of the
// library is built for CPUs without it). Unlike at::vec's, it rounds float32's subnormal numbers
// (below 1.2e-38) to 0: probabilities that small weigh nothing next to the row's largest, 1.
// (ATTNKIT_BF16 is defined above, with bf16_product.)

// 16 floats as bfloat16.
ATTNKIT_BF16 inline __m256i bf16_of(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// 16 floats of a row a and of the row b below it as 16 pairs for the matrix unit (a's in the low
// half of each 32-bit word).
ATTNKIT_BF16 inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                              9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                              17, 1, 16, 0);
  // (low half: a's 16, high half: b's)
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// n floats as bfloat16.
ATTNKIT_BF16 inline void row_to_bf16(const float* x, int64_t n, at::BFloat16* out) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), bf16_of(_mm512_loadu_ps(x + j)));
  }
  if (j < n) {
    const __mmask16 tail = __mmask16((1u << (n - j)) - 1);
    _mm256_mask_storeu_epi16(out + j, tail, bf16_of(_mm512_maskz_loadu_ps(tail, x + j)));
  }
}

// bf16_product on AVX512-BF16: C's rows MR at a time, 32 columns at a time (2 MR sums of 16
// lanes, one broadcast pair of A per row and two loads of B's pairs per step of 2 along k).
template <int MR>
ATTNKIT_BF16 inline void dot_rows(int64_t n, int64_t k, const at::BFloat16* a, int64_t lda,
                                  const at::BFloat16* b, int64_t ldb, float* c, int64_t ldc,
                                  bool add) {
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(b);
  for (int64_t j = 0; j < n; j += 32) {
    const int64_t left = n - j;
    const __mmask16 m0 = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __mmask16 m1 = left >= 32   ? __mmask16(0xFFFF)
                         : left <= 16 ? __mmask16(0)
                                      : __mmask16((1u << (left - 16)) - 1);
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = add ? _mm512_maskz_loadu_ps(m0, c + r * ldc + j) : _mm512_setzero_ps();
      acc[r][1] = add ? _mm512_maskz_loadu_ps(m1, c + r * ldc + j + 16) : _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < k / 2; ++p) {
      const uint32_t* row = bw + p * ldb + j;
      const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, row);
      const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, row + 16);
      for (int r = 0; r < MR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
        const __m512bh ar = (__m512bh)_mm512_set1_epi32(int(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm512_mask_storeu_ps(c + r * ldc + j, m0, acc[r][0]);
      _mm512_mask_storeu_ps(c + r * ldc + j + 16, m1, acc[r][1]);
    }
  }
}

ATTNKIT_BF16 inline void dot_product(int64_t m, int64_t n, int64_t k, const at::BFloat16* a,
                                     int64_t lda, const at::BFloat16* b, int64_t ldb, float* c,
                                     int64_t ldc, bool add) {
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) dot_rows<8>(n, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc, add);
  if (m - i >= 4) {
    dot_rows<4>(n, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc, add);
    i += 4;
  }
  if (m - i >= 2) {
    dot_rows<2>(n, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc, add);
    i += 2;
  }
  if (m - i >= 1) dot_rows<1>(n, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc, add);
}

// Rows of float32 as bfloat16 (nearest even), and whether every one was exact: the forward takes
// q in float32, and runs q k^T on the matrix unit only for queries that are bfloat16 values.
ATTNKIT_BF16 inline bool to_bf16_exact(const float* x, int64_t n, at::BFloat16* out) {
  row_to_bf16(x, n, out);
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
inline bool has_bf16_products() { return false; }
#endif

}  // namespace
}  // namespace attnkit
