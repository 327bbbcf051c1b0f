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

// (out, lse): out laid out as q (see like_q), lse (N, Hkv, G, Tq) in natural log.
std::tuple<at::Tensor, at::Tensor> forward(const CallArgs& a);

// (dq, dk, dv, dbias, dqv, denc): dbias in the bias's shape (a bias by distance: its table's),
// undefined where not asked for.
std::vector<at::Tensor> backward(const CallArgs& a, const BackwardArgs& b);

// Whether every element of these float32/float64 tensors is finite (one read of each).
bool all_finite(at::TensorList tensors);

at::Tensor like_q(const at::Tensor& q, int64_t d);
at::Tensor like_kv(const at::Tensor& k);

}  // namespace attnkit
