// The kernel as PyTorch operators: torch.ops.attnkit.native_forward, native_backward,
// native_backward_into, native_cache_forward, native_stats and all_finite (gathered.cpp adds
// gathered_forward and gathered_backward). Their fake (meta) kernels are registered in Python
// (attnkit/_native/ops.py); none has an autograd formula: the kernel's autograd entries call them
// (attnkit/_kernel/phases.py). native_forward takes the decode path (decode.cpp) for calls of a
// few queries.
//
// A call's block plan comes as tensors (offsets, visits) and its mask as band, key flags or bool
// tiles (see attnkit/_native/kernel.py); every index in them is checked before the kernel follows
// it (plan.h). A kernel's settings (register_tiles, skewed_position) are arguments: they choose
// how the products run, never what they compute.

#include <torch/library.h>

#include "kernel.h"

namespace attnkit {
namespace {

// The arguments every operator shares: the call's tensors (positional, so that autograd can
// give each its gradient), then its settings.
#define ATTNKIT_CALL_ARGS                                                                        \
  "Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor visits, Tensor? bias=None, "             \
  "Tensor? key_ok=None, Tensor? tiles=None, Tensor? qv=None, Tensor? enc=None, "                 \
  "Tensor? k_scale=None, Tensor? v_scale=None, *, int block_q, "                                   \
  "int block_k, float scale, float softcap=0., int[] bias_layout=[], float[] band=[], "          \
  "int shift=0, int stretch=0, float dropout_p=0., int seed=0, float rel_scale=0., "             \
  "int rel_top=0, int whole_width=0, bool register_tiles=True, bool skewed_position=True"

#define ATTNKIT_CALL_PARAMS                                                                       \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &offsets,       \
      const at::Tensor &visits, const c10::optional<at::Tensor>&bias,                             \
      const c10::optional<at::Tensor>&key_ok, const c10::optional<at::Tensor>&tiles,              \
      const c10::optional<at::Tensor>&qv, const c10::optional<at::Tensor>&enc,                    \
      const c10::optional<at::Tensor>&k_scale, const c10::optional<at::Tensor>&v_scale,           \
      int64_t block_q,                                                                            \
      int64_t block_k, double scale, double softcap, c10::IntArrayRef bias_layout,                \
      c10::ArrayRef<double> band, int64_t shift, int64_t stretch, double dropout_p, int64_t seed, \
      double rel_scale, int64_t rel_top, int64_t whole_width, bool register_tiles,                \
      bool skewed_position

#define ATTNKIT_CALL_VALUES                                                                 \
  q, k, v, offsets, visits, bias, key_ok, tiles, qv, enc, k_scale, v_scale, block_q, block_k, \
      scale, softcap,                                                                      \
      bias_layout, band, shift, stretch, dropout_p, seed, rel_scale, rel_top, whole_width,  \
      register_tiles, skewed_position

CallArgs call_args(ATTNKIT_CALL_PARAMS) {
  CallArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.offsets = offsets;
  a.visits = visits;
  a.bias = bias;
  a.key_ok = key_ok;
  a.tiles = tiles;
  a.qv = qv;
  a.enc = enc;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.block_q = block_q;
  a.block_k = block_k;
  a.scale = scale;
  a.softcap = softcap;
  a.bias_layout = bias_layout.vec();
  a.band = band.vec();
  a.shift = shift;
  a.stretch = stretch;
  a.p_drop = dropout_p;
  a.seed = seed;
  a.rel_scale = rel_scale;
  a.top = rel_top;
  a.whole_width = whole_width;
  a.register_tiles = register_tiles;
  a.skewed_position = skewed_position;
  return a;
}

// The backward reads keys and values in q's dtype, or bfloat16: int8 and float8 ones (and their
// scales) are dequantized by the caller, whose gradients then reach the scales.
void no_quantized_backward(const c10::optional<at::Tensor>& k_scale,
                           const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(),
              "attnkit::native_backward: no backward through int8/float8 keys and values; "
              "dequantize them (k.float() * k_scale) for a call that needs gradients");
}

// A gradient not asked for: an empty tensor (schemas return Tensor, not Tensor?).
at::Tensor or_empty(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t : empty({0}, like.options());
}

std::tuple<at::Tensor, at::Tensor> native_forward(ATTNKIT_CALL_PARAMS) {
  const CallArgs a = call_args(ATTNKIT_CALL_VALUES);
  // int8 and float8 keys and values, with their scales: the decode path alone reads them (their
  // products in float32; bfloat16 queries converted first and the output back).
  if (k_scale.has_value() || v_scale.has_value() || is_quantized_type(k.scalar_type())) {
    TORCH_CHECK(decodes(a), "attnkit::native_forward: ", k.scalar_type(), " keys and values are ",
                "read on the decode path alone (one query block of at most 16 queries), got ",
                q.dim() == 5 ? q.size(3) : -1, " queries in blocks of ", block_q);
    if (q.scalar_type() != at::kBFloat16) return decode(a);
    CallArgs f = a;
    f.q = q.to(at::kFloat);
    auto [out, lse] = decode(f);
    return {out.to(at::kBFloat16), lse};
  }
  // bfloat16 queries, with bfloat16 keys and values: the output in bfloat16, the log-sum-exp in
  // float32. The matrix unit's forward reads them as they are; elsewhere (decode steps included,
  // whose queries are few) they are converted to float32 first and the output back.
  if (q.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
                "attnkit::native_forward: bfloat16 queries take bfloat16 keys and values, got ",
                k.scalar_type(), " and ", v.scalar_type());
    if (!decodes(a)) return forward(a);
    CallArgs f = a;
    f.q = q.to(at::kFloat);
    auto [out, lse] = decode(f);
    return {out.to(at::kBFloat16), lse};
  }
  return decodes(a) ? decode(a) : forward(a);
}

std::tuple<at::Tensor, at::Tensor> native_cache_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& block_table, const c10::optional<at::Tensor>& kv_range,
    const c10::optional<at::Tensor>& q_range, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& key_ok, const c10::optional<at::Tensor>& k_scale,
    const c10::optional<at::Tensor>& v_scale, double scale, double softcap,
    c10::IntArrayRef bias_layout, c10::ArrayRef<double> band, int64_t block_q,
    bool register_tiles) {
  CacheArgs a;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.q = q;
  a.k = k;
  a.v = v;
  a.block_table = block_table;
  a.kv_range = kv_range;
  a.q_range = q_range;
  a.bias = bias;
  a.key_ok = key_ok;
  a.scale = scale;
  a.softcap = softcap;
  a.bias_layout = bias_layout.vec();
  a.band = band.vec();
  a.block_q = block_q;
  a.register_tiles = register_tiles;
  return cache_forward(a);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> native_backward(
    const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& delta, ATTNKIT_CALL_PARAMS,
    bool bias_grad, bool qv_grad, bool enc_grad) {
  BackwardArgs b;
  b.dout = dout;
  b.lse = lse;
  b.delta = delta;
  b.bias_grad = bias_grad;
  b.qv_grad = qv_grad;
  b.enc_grad = enc_grad;
  no_quantized_backward(k_scale, v_scale);
  const auto g = backward(call_args(ATTNKIT_CALL_VALUES), b);
  return {g[0], g[1], g[2], or_empty(g[3], q), or_empty(g[4], q), or_empty(g[5], q)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_backward_into(
    const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq,
    at::Tensor& dk, at::Tensor& dv, ATTNKIT_CALL_PARAMS, bool bias_grad, bool qv_grad,
    bool enc_grad) {
  BackwardArgs b;
  b.dout = dout;
  b.lse = lse;
  b.delta = delta;
  b.bias_grad = bias_grad;
  b.qv_grad = qv_grad;
  b.enc_grad = enc_grad;
  b.dq = dq;
  b.dk = dk;
  b.dv = dv;
  no_quantized_backward(k_scale, v_scale);
  const auto g = backward(call_args(ATTNKIT_CALL_VALUES), b);
  return {or_empty(g[3], q), or_empty(g[4], q), or_empty(g[5], q)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_stats(const at::Tensor& lse,
                                                            ATTNKIT_CALL_PARAMS) {
  return stats(call_args(ATTNKIT_CALL_VALUES), lse);
}

bool all_finite_op(at::TensorList tensors) { return all_finite(tensors); }

}  // namespace
}  // namespace attnkit

TORCH_LIBRARY(attnkit, m) {
  m.def("native_forward(" ATTNKIT_CALL_ARGS ") -> (Tensor out, Tensor lse)");
  m.def("native_backward(Tensor dout, Tensor lse, Tensor delta, " ATTNKIT_CALL_ARGS
        ", bool bias_grad=False, bool qv_grad=False, bool enc_grad=False) -> (Tensor dq, "
        "Tensor dk, Tensor dv, Tensor dbias, Tensor dqv, Tensor denc)");
  m.def(
      "native_backward_into(Tensor dout, Tensor lse, Tensor delta, Tensor(a!) dq, "
      "Tensor(b!) dk, Tensor(c!) dv, " ATTNKIT_CALL_ARGS
      ", bool bias_grad=False, bool qv_grad=False, bool enc_grad=False) -> (Tensor dbias, "
      "Tensor dqv, Tensor denc)");
  m.def(
      "native_cache_forward(Tensor q, Tensor k, Tensor v, Tensor? block_table=None, "
      "Tensor? kv_range=None, Tensor? q_range=None, Tensor? bias=None, Tensor? key_ok=None, "
      "Tensor? k_scale=None, Tensor? v_scale=None, *, "
      "float scale, float softcap=0., int[] bias_layout=[], float[] band=[], int block_q=16, "
      "bool register_tiles=True) -> (Tensor out, Tensor lse)");
  m.def("native_stats(Tensor lse, " ATTNKIT_CALL_ARGS
        ") -> (Tensor key_mass, Tensor key_max, Tensor entropy)");
  m.def("all_finite(Tensor[] tensors) -> bool");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("native_forward", &attnkit::native_forward);
  m.impl("native_backward", &attnkit::native_backward);
  m.impl("native_backward_into", &attnkit::native_backward_into);
  m.impl("native_cache_forward", &attnkit::native_cache_forward);
  m.impl("native_stats", &attnkit::native_stats);
}

// No dispatch by device: it refuses tensors that are not on the CPU itself.
TORCH_LIBRARY_IMPL(attnkit, CompositeExplicitAutograd, m) {
  m.impl("all_finite", &attnkit::all_finite_op);
}
