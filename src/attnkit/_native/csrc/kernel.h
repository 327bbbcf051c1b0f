// The kernel's entry points, as the operators (ops.cpp) call them.
#pragma once

#include "plan.h"

namespace attnkit {

// What the backward takes besides the call: the output's gradient, the forward's log-sum-exp,
// delta = rowsum(dO * O) (less the log-sum-exp's gradient), which gradients to compute, and
// optionally tensors to write dq, dk and dv into (undefined: new ones, laid out as the inputs).
struct BackwardArgs {
  at::Tensor dout;   // (N, Hkv, G, Tq, Dv)
  at::Tensor lse;    // (N, Hkv, G, Tq), natural log
  at::Tensor delta;  // (N, Hkv, G, Tq)
  bool bias_grad = false, qv_grad = false, enc_grad = false;
  at::Tensor dq, dk, dv;
};

// (out, lse): out laid out as q (see like_q), lse (N, Hkv, G, Tq) in natural log. bfloat16
// queries (with bfloat16 keys and values): out in bfloat16, lse in float32.
std::tuple<at::Tensor, at::Tensor> forward(const CallArgs& a);

// Whether a call of native_forward takes the decode path (few queries, one query block), and
// that path: the same (out, lse) as forward (decode.cpp).
bool decodes(const CallArgs& a);
std::tuple<at::Tensor, at::Tensor> decode(const CallArgs& a);

// A call of native_cache_forward: queries against keys and values read in place as pages
// (X, Hkv, page, D) at any strides, through a block table (N, pages) or one page per row; row n's
// keys [kv_range[n][0], kv_range[n][1]), its queries q's batch row n or, with q_range, the
// queries [q_range[n][0], q_range[n][0] + q_range[n][1]) of q's one batch row, aligned to the end
// of its keys; masked by a band relative to each row's alignment, key flags (N|1, Tk) and a bias
// (N|1, Hkv|1, G|1, Tq|1, Tk|1) or by distance from each row's alignment, Tq and Tk the longest
// row's queries and end of keys. int8 or float8 pages come with their scales (k_scale, v_scale).
struct CacheArgs {
  at::Tensor q, k, v;  // (N, Hkv, G, Tq, Dk), (X, Hkv, page, Dk), (X, Hkv, page, Dv)
  c10::optional<at::Tensor> block_table, kv_range, q_range, bias, key_ok;
  // int8/float8 pages' scales: float32 (X, Hkv, page), strides 0 where broadcast
  c10::optional<at::Tensor> k_scale, v_scale;
  double scale = 1, softcap = 0;
  std::vector<int64_t> bias_layout;
  std::vector<double> band;
  int64_t block_q = 16;
  bool register_tiles = true;
};

// (out, lse) as forward's.
std::tuple<at::Tensor, at::Tensor> cache_forward(const CacheArgs& a);

// (dq, dk, dv, dbias, dqv, denc): dbias in the bias's shape (a bias by distance: its table's),
// undefined where not asked for.
std::vector<at::Tensor> backward(const CallArgs& a, const BackwardArgs& b);

// (key_mass, key_max, entropy) of a call whose rows' natural-log log-sum-exp is lse (N, Hkv, G,
// Tq): the weights' column sums and maxima (N, Hkv, G, Tk) and the rows' entropies (N, Hkv, G,
// Tq), in q's dtype (float32 or float64, as k's); v is unused (stats.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats(const CallArgs& a, const at::Tensor& lse);

// Whether every element of these float32, float64, bfloat16 or float16 tensors is finite (one
// read of each).
bool all_finite(at::TensorList tensors);

at::Tensor like_q(const at::Tensor& q, int64_t d);
// A (N, Hkv, T, D) tensor laid out like k (token-major when it is), of k's dtype or dtype.
at::Tensor like_kv(const at::Tensor& k, c10::optional<at::ScalarType> dtype = c10::nullopt);

}  // namespace attnkit
