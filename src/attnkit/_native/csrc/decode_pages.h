// The decode path's access to keys and values: pages (X, Hkv, page, D) at any strides, read in
// place through a block table or one page per batch row (Pages), the rows of a step wherever they
// lie (RowList), and the next step's rows asked of memory while this step computes (Ahead).
#pragma once

#include "common.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

// The stretch within which the hardware prefetchers follow ascending lines: a 4 KiB page.
constexpr int64_t kStreamBytes = 4096;

// Keys or values as pages: (X, Hkv, page, D) rows. Without a block table, batch row n is page n and
// holds all its keys; with one, key j of row n is row j % page of page table[n][j / page].
template <typename T>
struct Pages {
  Rows<const T*> x;
  const int64_t* table = nullptr;  // (N, table_ld)
  int64_t table_ld = 0, page = 1;
  // Quantized rows' scales: float32 (X, Hkv, page), one per row, at strides ss (0 where
  // broadcast); a row's elements times its scale are the keys or values the call sees.
  const float* scale = nullptr;
  int64_t ss[3] = {0, 0, 0};

  const T* at(int64_t n, int64_t hk, int64_t j) const {
    if (table == nullptr) return x.at(n, hk, 0, j);
    return x.at(table[n * table_ld + j / page], hk, 0, j % page);
  }
  const float* scale_at(int64_t n, int64_t hk, int64_t j) const {
    if (table == nullptr) return scale + n * ss[0] + hk * ss[1] + j * ss[2];
    return scale + table[n * table_ld + j / page] * ss[0] + hk * ss[1] + (j % page) * ss[2];
  }
  // One past the last key of j's page (a row's last key + 1 without a table: e).
  int64_t page_end(int64_t j, int64_t e) const {
    return table == nullptr ? e : std::min(e, j - j % page + page);
  }
  // Whether the rows of one head are further apart than those of one key (a cache laid out
  // (B, Tk, Hkv, D), flash-attn's pages): then one item reads all key/value heads step by step
  // instead of one head's rows a few hundred bytes apart across the whole cache.
  bool token_major() const { return x.s[3] > x.s[1]; }
  // How many tokens of token-major rows share a page of kStreamBytes (1 when a token fills one or
  // more, or when tokens do not divide it).
  int64_t tokens_per_stream() const {
    const int64_t bytes = x.s[3] * int64_t(sizeof(T));
    return bytes > 0 && bytes < kStreamBytes && kStreamBytes % bytes == 0 ? kStreamBytes / bytes
                                                                          : 1;
  }
};

// A hint to bring a line into L2. (GCC drops __builtin_prefetch from these loops once they are
// inlined; an asm statement it must keep.)
inline void to_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// The rows of a step's keys or values, wherever they lie (in one stretch of memory, or in pages):
// row j is p[j] + off (off: the key/value head's place beside the first head of the item).
template <typename T>
struct RowList {
  const T* const* p = nullptr;
  int64_t off = 0;
  const T* operator[](int64_t j) const { return p[j] + off; }
};

// Lines of rows [j, end) (bytes each) to ask for one at a time: count() of them, from row j's
// first; next() asks for one. (The compiler's prefetch: to_l2's asm statement, kept in place,
// made the products it sits among slower.)
template <typename X>
struct AskedLines {
  RowList<X> k;
  int64_t j = 0, end = 0, at = 0, bytes = 0;
  int64_t count() const { return (end - j) * ((bytes + 63) / 64) - at / 64; }
  void next() {
    __builtin_prefetch(reinterpret_cast<const char*>(k[j]) + at, 0, 2);
    at += 64;
    if (at >= bytes) {
      at = 0;
      ++j;
    }
  }
};

// The rows of keys and values of the step after this one, asked of memory while this step's
// products run, a row for each of its keys: the hardware's prefetchers alone do not run far enough
// ahead of a core that also computes (a decode then takes the time of its memory traffic plus that
// of its products, instead of the larger of the two), nor across pages.
template <typename X>
struct Ahead {
  RowList<X> k, v;
  int64_t rows = 0, k_bytes = 0, v_bytes = 0;

  void ask(int64_t first, int64_t last) const {
    for (int64_t j = first; j < last; ++j) {
      const char* kr = reinterpret_cast<const char*>(k[j]);
      const char* vr = reinterpret_cast<const char*>(v[j]);
      for (int64_t at = 0; at < k_bytes; at += 64) to_l2(kr + at);
      for (int64_t at = 0; at < v_bytes; at += 64) to_l2(vr + at);
    }
  }
  // The rows that keys [j0, j1) of a step of n keys ask for.
  void for_keys(int64_t j0, int64_t j1, int64_t n) const {
    if (j0 < rows) ask(j0, j1 >= n ? rows : std::min(j1, rows));
  }
  // The lines of the keys' rows that for_keys(j0, j1, n) asks for, for a caller that asks for
  // them one at a time among its products (AskedLines); the values' lines are asked for now.
  AskedLines<X> lines_for_keys(int64_t j0, int64_t j1, int64_t n) const {
    AskedLines<X> out;
    if (j0 >= rows) return out;
    out.k = k;
    out.j = j0;
    out.end = j1 >= n ? rows : std::min(j1, rows);
    out.bytes = k_bytes;
    for (int64_t j = j0; j < out.end; ++j) {
      const char* vr = reinterpret_cast<const char*>(v[j]);
      for (int64_t at = 0; at < v_bytes; at += 64) to_l2(vr + at);
    }
    return out;
  }
};

// The rows of keys [j0, j1) of (n, hk): out[j - j0].
template <typename T>
void rows_of_keys(const Pages<T>& x, int64_t n, int64_t hk, int64_t j0, int64_t j1, const T** out) {
  for (int64_t j = j0; j < j1;) {
    const int64_t e = x.page_end(j, j1), ld = x.x.ld();
    const T* p = x.at(n, hk, j);
    for (int64_t i = j; i < e; ++i) out[i - j0] = p + (i - j) * ld;
    j = e;
  }
}

// The scales of keys [j0, j1) of (n, hk): out[j - j0].
template <typename T>
void scales_of(const Pages<T>& x, int64_t n, int64_t hk, int64_t j0, int64_t j1, float* out) {
  // A page at a time, as rows_of_keys: one lookup in the block table a page, not a key.
  for (int64_t j = j0; j < j1;) {
    const int64_t e = x.page_end(j, j1), step = x.ss[2];
    const float* p = x.scale_at(n, hk, j);
    for (int64_t i = j; i < e; ++i) out[i - j0] = p[(i - j) * step];
    j = e;
  }
}

// s's columns (rows of nk, ld apart) times their keys' scales: the product of a query with a
// quantized key is the product with its elements times the key's scale, and a weight times a
// value's scale weighs its elements.
inline void scale_columns(float* s, int64_t nr, int64_t nk, int64_t ld, const float* scale) {
  for (int64_t r = 0; r < nr; ++r) {
    float* row = s + r * ld;
    for (int64_t j = 0; j < nk; ++j) row[j] *= scale[j];
  }
}

template <typename T>
Pages<T> pages_of(const at::Tensor& x) {
  Pages<T> p;
  p.x = rows_of<const T*>(x, x.data_ptr<T>());
  p.page = std::max<int64_t>(x.size(2), 1);
  return p;
}

// Quantized pages with their scales: a float32 (X, Hkv, page) tensor of any strides.
template <typename T>
Pages<T> pages_of(const at::Tensor& x, const c10::optional<at::Tensor>& scale, const char* name) {
  Pages<T> p = pages_of<T>(x);
  if constexpr (is_quantized<T>) {
    TORCH_CHECK(scale.has_value(), "attnkit: ", x.scalar_type(), " ", name, " takes ", name,
                "_scale");
    const at::Tensor& s = *scale;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.size(0) == x.size(0) &&
                    s.size(1) == x.size(1) && s.size(2) == x.size(2),
                "attnkit: ", name, "_scale must be float32 (", x.size(0), ", ", x.size(1), ", ",
                x.size(2), ") (strides 0 where broadcast), got ", s.scalar_type(), " ", s.sizes());
    p.scale = s.data_ptr<float>();
    for (int d = 0; d < 3; ++d) p.ss[d] = s.stride(d);
  } else {
    TORCH_CHECK(!scale.has_value(), "attnkit: ", name, "_scale is for int8/float8 ", name,
                ", got ", name, " of ", x.scalar_type());
  }
  return p;
}

}  // namespace
}  // namespace attnkit
