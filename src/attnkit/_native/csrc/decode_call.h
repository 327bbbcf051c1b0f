// A decode call (Decode): the call, its pages of keys and values and how its items divide the
// work; an item's place (Item), and a thread's buffers (DecodeBuffers), sized by the steps.
#pragma once

#include "decode_pages.h"
#include "plan.h"

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

// Keys per step of an item: the step's scores stay in L1, its keys and values in L2 while all the
// query heads of their key/value heads read them.
constexpr int64_t kStep = 128;
// Query rows (over all heads of an item) up to which the product q k^T runs as dot products here;
// more take a GEMM.
constexpr int64_t kDotRows = 8;
// Values per block of a step of more rows (decode_group.h's group_weigh): converted once, then
// read by every row.
constexpr int64_t kGroupValues = 16;
// Keys per step of an item of at most kDotRows rows whose rows are read a head at a time (see
// run_visit): short steps alternate the products of keys and of values, and with them the
// prefetches of the next keys and values (see run_step), often enough to keep memory busy
// through both. Float32 rows gained the most from steps of 16 keys; bfloat16 and float16 rows,
// converted in registers as they are read, gained nothing below 64.
template <typename KV>
constexpr int64_t kFewRowsStep = sizeof(KV) >= 4 ? 16 : 64;
// Keys per step of such an item read token by token (see run_token_step).
constexpr int64_t kTokenStep = 64;
// Keys of a token-major step read for all the item's heads in turn (see run_token_step): two of
// dot_block's blocks of 4, few pages at a time for the prefetchers (of 4, 8 and 16, 8 was the
// fastest for 8 heads of 128 in bfloat16, two tokens to a page, and as fast as 16 in float32).
constexpr int64_t kTokenBlock = 8;

// A decode call: the call (its plan, when the visits come from it), the pages, and how its items
// divide the work. The products are computed in T; keys and values are KV, T itself or, for a
// float32 call, bfloat16 or float16 read as they are (half the bytes) and converted in registers,
// or int8 or float8 with their scales (a quarter of the bytes).
template <typename T, typename KV = T>
struct Decode {
  Call<T> c;
  Pages<KV> k, v;
  // (N, 2): row n's keys are [range[2n], range[2n + 1]) and its queries are aligned to the end;
  // null: all Tk keys, the plan's visits.
  const int64_t* range = nullptr;
  // (N, 2): row n's queries are [qrange[2n], qrange[2n] + qrange[2n + 1]) of packed queries
  // (q, out and lse of one batch row, q_total queries); null: q's batch row n, all Tq queries.
  const int64_t* qrange = nullptr;
  int64_t q_total = 0;
  int64_t bq = 1, nqb = 1;  // query rows per block, query blocks
  // Key/value heads per item, their groups, and parts of each row's keys; items per thread.
  int64_t heads = 1, groups = 1, parts = 1, grain = 1;

  int64_t items() const { return c.N * groups * nqb * parts; }
  int64_t q_row(int64_t n) const { return qrange == nullptr ? n : 0; }
  int64_t q_first(int64_t n) const { return qrange == nullptr ? 0 : qrange[2 * n]; }
  int64_t q_len(int64_t n) const { return qrange == nullptr ? c.Tq : qrange[2 * n + 1]; }
  int64_t rows() const { return bq * c.G; }  // an item's rows per key/value head
};

// Whether a call's products may run on bfloat16 weights and value pairs (float32 products of
// bfloat16 keys and values, more than kDotRows rows a key/value head: see group_weigh_bf16).
template <typename T, typename KV>
constexpr bool kBf16Pairs = std::is_same_v<T, float> && std::is_same_v<KV, at::BFloat16>;
template <typename T, typename KV>
bool holds_bf16_pairs(const Decode<T, KV>& d) {
  return kBf16Pairs<T, KV> && d.rows() > kDotRows;
}

// One thread's buffers: the item's query rows (heads x rows x Dk, rows ordered (query, head)), a
// step's scores, the position term's window, and the online softmax's state of every row.
template <typename T, typename KV>
struct DecodeBuffers {
  std::vector<T> q, s, pos, acc, m, l;
  // The item's queries in bfloat16 where they are bfloat16 values, the keys are bfloat16 and the
  // CPU has AVX512-BF16 (q16_ok): q k^T then runs on its dot products (see key_dots).
  std::vector<at::BFloat16> q16;
  bool q16_ok = false;
  // A grouped step's weights in bfloat16, where its products run on AVX512-BF16's dot products
  // (see group_weigh_bf16).
  std::vector<at::BFloat16> w16;
  // There, each key/value head's query rows packed in 16 lanes (see pack_lanes), lanes_count
  // rows from row lanes_first of the head's first (-1: none yet since the item's queries were loaded).
  std::vector<at::BFloat16> q_lanes;
  std::vector<int64_t> lanes_first, lanes_count;
  // Where q_lanes' blocks start: its first 64-byte boundary (a register's load of a packed word
  // of 16 rows then never spans two cache lines).
  at::BFloat16* lanes() {
    const auto at = reinterpret_cast<std::uintptr_t>(q_lanes.data());
    return q_lanes.data() + ((64 - at % 64) % 64) / sizeof(at::BFloat16);
  }
  // A step's scales of quantized keys and values, for each head of the item (see run_step).
  std::vector<float> k_scales, v_scales;
  std::vector<T> t;             // a careful step's terms alone (see run_step)
  std::vector<uint8_t> hidden;  // a careful step's hidden pairs
  // The rows of this step's keys and values, and of the next step's, for the item's first head.
  std::vector<const KV*> keys, values, next_keys, next_values;
  // A step's keys and values in T, for the GEMMs of steps of many rows (keys and values in
  // another dtype than T only), made on first use (wide_keys, wide_values): steps on AVX512-BF16's
  // dot products never take them, and a call's first touch of half a MiB cost it 40 us.
  std::vector<T> wide_k, wide_v;
  int64_t wide_k_size = 0, wide_v_size = 0;
  T* wide_keys() {
    if (int64_t(wide_k.size()) < wide_k_size) wide_k.resize(wide_k_size);
    return wide_k.data();
  }
  T* wide_values() {
    if (int64_t(wide_v.size()) < wide_v_size) wide_v.resize(wide_v_size);
    return wide_v.data();
  }
  // A token-major step's scores of every head of the item, in the order its keys are read and,
  // when that is another, in the keys' order (see run_token_step); the rows in reading order.
  std::vector<T> read_s, key_s;
  std::vector<const KV*> read_keys, read_values;
  std::vector<int64_t> read_order;
  explicit DecodeBuffers(const Decode<T, KV>& d)
      : q(d.heads * d.rows() * d.c.Dk),
        s(d.rows() * kStep),
        pos(d.c.qv.p == nullptr ? 0 : d.bq * (kStep + d.bq - 1)),
        acc(d.heads * d.rows() * d.c.Dv),
        m(d.heads * d.rows()),
        l(d.heads * d.rows()),
        w16(holds_bf16_pairs(d) ? d.rows() * (kStep + 2) : 0),
        q_lanes(holds_bf16_pairs(d)
                    ? d.heads * ((d.rows() + 15) / 16) * 32 * ((d.c.Dk + 1) / 2) + 32
                    : 0),
        lanes_first(d.heads, -1),
        lanes_count(d.heads, -1),
        k_scales(is_quantized<KV> ? d.heads * kStep : 0),
        v_scales(k_scales.size()),
        t(d.rows() * kStep),
        hidden(d.rows() * kStep),
        keys(kStep),
        values(kStep),
        next_keys(kStep),
        next_values(kStep),
        wide_k_size(std::is_same_v<T, KV> ? 0 : kStep * d.c.Dk),
        wide_v_size(std::is_same_v<T, KV> ? 0 : kStep * d.c.Dv),
        read_s(d.heads > 1 ? d.heads * kDotRows * kTokenStep : 0),
        key_s(read_s.size()),
        read_keys(d.heads > 1 ? kTokenStep : 0),
        read_values(read_keys.size()),
        read_order(read_keys.size()) {}
};

// Where an item is: batch row, first key/value head and how many, query block and its rows, part.
struct Item {
  int64_t n, hk0, heads, qb, qs, nq, part;
};

template <typename T, typename KV>
Item item_of(const Decode<T, KV>& d, int64_t item) {
  Item it;
  it.part = item % d.parts;
  int64_t rest = item / d.parts;
  it.qb = rest % d.nqb;
  rest /= d.nqb;
  const int64_t gi = rest % d.groups;
  it.n = rest / d.groups;
  it.hk0 = gi * d.heads;
  it.heads = std::min(d.heads, d.c.Hkv - it.hk0);
  it.qs = it.qb * d.bq;
  it.nq = std::max<int64_t>(0, std::min(d.bq, d.q_len(it.n) - it.qs));
  return it;
}

}  // namespace
}  // namespace attnkit
