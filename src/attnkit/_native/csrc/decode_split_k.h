// Split-K: a row's keys cut into parts (part_of), each part's online-softmax state (acc, m, l)
// kept (Parts) and merged exactly, from the parts' maxima and sums, by the thread that finishes
// the last part of an item (finish_item), in the same call; out and lse written from a
// row's state (write_row).
#pragma once

#include <atomic>
#include <memory>
#include "decode_call.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

// Part p of P of the keys [k0, k1): its stretch, cut at multiples of 16 keys.
inline void part_of(int64_t k0, int64_t k1, int64_t p, int64_t P, int64_t& a, int64_t& z) {
  auto cut = [&](int64_t x) {
    if (x <= 0) return k0;
    if (x >= P) return k1;
    const int64_t at = k0 + (k1 - k0) * x / P;
    return std::max(k0, at - at % 16);
  };
  a = cut(p);
  z = cut(p + 1);
}

// A row's out and lse from its (m, l, acc) in base 2: a row that sees no key gets zeros and -inf, a
// NaN sum (a NaN or +inf score it sees) NaN, as in the blocked forward. unit: what the values were
// read as, over their values (kQuantizedUnit).
template <typename T>
void write_row(T m, T l, const T* acc, int64_t dv, T* o, T* lse, T unit) {
  if (l > T(0) || std::isnan(l)) {
    const T inv = T(1) / l / unit;
    for (int64_t e = 0; e < dv; ++e) o[e] = acc[e] * inv;
    *lse = T((m + std::log2(l)) * kLn2);
  } else {
    // Nothing seen: 0, or NaN in a dimension where a key the mask lets the row see holds a NaN or
    // inf value (a careful item, see weigh_seen).
    for (int64_t e = 0; e < dv; ++e) o[e] = acc[e] * T(0);
    *lse = -std::numeric_limits<T>::infinity();
  }
}

// Where the parts of the items keep (acc, m, l) until the last of them merges them.
template <typename T>
struct Parts {
  std::vector<T> buf;
  std::unique_ptr<std::atomic<int64_t>[]> done;
  int64_t stride = 0;  // per item: heads x rows x (Dv + 2)

  template <typename KV>
  explicit Parts(const Decode<T, KV>& d) {
    if (d.parts == 1) return;
    stride = d.heads * d.rows() * (d.c.Dv + 2);
    buf.resize(size_t(d.items() * stride));
    done.reset(new std::atomic<int64_t>[size_t(d.items() / d.parts)]());
  }
  T* acc(int64_t item) { return buf.data() + item * stride; }
  template <typename KV>
  T* m(const Decode<T, KV>& d, int64_t item) {
    return acc(item) + d.heads * d.rows() * d.c.Dv;
  }
  template <typename KV>
  T* l(const Decode<T, KV>& d, int64_t item) {
    return m(d, item) + d.heads * d.rows();
  }
};

// The item's rows: written to out and lse when it is the only part, else kept, and merged with the
// other parts' by the thread that finishes the last of them.
template <typename T, typename KV>
void finish_item(const Decode<T, KV>& d, DecodeBuffers<T, KV>& b, Parts<T>& parts, int64_t item,
                 const Item& it, const Rows<T*>& out, T* lse) {
  const Call<T>& c = d.c;
  const int64_t G = c.G, R = d.rows(), Dv = c.Dv;
  auto lse_at = [&](int64_t hk, int64_t g, int64_t i) {
    return lse + ((d.q_row(it.n) * c.Hkv + hk) * G + g) * d.q_total + d.q_first(it.n) + i;
  };
  if (d.parts == 1) {
    for (int64_t hh = 0; hh < it.heads; ++hh) {
      for (int64_t r = 0; r < it.nq * G; ++r) {
        const int64_t x = hh * R + r, hk = it.hk0 + hh, g = r % G, i = it.qs + r / G;
        write_row(b.m[x], b.l[x], b.acc.data() + x * Dv, Dv,
                  out.at(d.q_row(it.n), hk, g, d.q_first(it.n) + i), lse_at(hk, g, i),
                  T(kQuantizedUnit<KV>));
      }
    }
    return;
  }
  std::copy(b.acc.begin(), b.acc.end(), parts.acc(item));
  std::copy(b.m.begin(), b.m.end(), parts.m(d, item));
  std::copy(b.l.begin(), b.l.end(), parts.l(d, item));
  const int64_t group = item / d.parts;
  if (parts.done[group].fetch_add(1, std::memory_order_acq_rel) != d.parts - 1) return;
  const int64_t item0 = group * d.parts;
  std::vector<T> o(Dv);
  for (int64_t hh = 0; hh < it.heads; ++hh) {
    for (int64_t r = 0; r < it.nq * G; ++r) {
      const int64_t x = hh * R + r, hk = it.hk0 + hh, g = r % G, i = it.qs + r / G;
      T top = -std::numeric_limits<T>::infinity();
      for (int64_t p = 0; p < d.parts; ++p) top = std::max(top, parts.m(d, item0 + p)[x]);
      const T safe = std::isinf(top) && top < 0 ? T(0) : top;
      T l = 0;
      std::fill(o.begin(), o.end(), T(0));
      for (int64_t p = 0; p < d.parts; ++p) {
        const T w = std::exp2(parts.m(d, item0 + p)[x] - safe);  // 0 for a part that saw nothing
        l += parts.l(d, item0 + p)[x] * w;
        const T* a = parts.acc(item0 + p) + x * Dv;
        for (int64_t e = 0; e < Dv; ++e) o[e] += a[e] * w;
      }
      write_row(top, l, o.data(), Dv, out.at(d.q_row(it.n), hk, g, d.q_first(it.n) + i),
                lse_at(hk, g, i), T(kQuantizedUnit<KV>));
    }
  }
}

}  // namespace
}  // namespace attnkit
