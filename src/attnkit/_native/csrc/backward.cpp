// The backward: one parallel region per call. Its items are (batch, key/value head, a stretch of
// query blocks): each recomputes its blocks' probabilities from the saved log-sum-exp and
// accumulates dq for its own rows and dk/dv for its key/value head, in place when it is the
// head's only stretch, else in its own buffer, summed after the parallel region. No two items
// write the same memory. The phases: the stretches (QueryStretches), an item's rows zeroed
// (zero_item_rows), a query block (block_backward) and its visits (visit_backward), then the
// sums of what several items or threads added to (sum_denc, sum_dbias, sum_dkdv).
//
// The state and the steps both paths share are in backward.h; the products of a bfloat16 call on
// the matrix unit in backward_matrix_unit.h; here, the generic visit, a query block, the sums,
// the parallel region and the entry point, which checks the arguments.

#include "kernel.h"

#include "backward.h"
#include "backward_matrix_unit.h"

namespace attnkit {
namespace {

// One visit of query head g over query block qs: its probabilities from the log-sum-exp, dP,
// dropout, dV, dS and what it adds to dbias and the position term's gradients, then dQ (into
// the block's dqa) and dK.
template <typename T>
void visit_backward(Backward<T>& w, BackwardBuffers<T>& b, const KeyGrads<T>& kg, int64_t n,
                    int64_t hk, int64_t g, int64_t qs, const int64_t* vis, bool skew,
                    const Window<T>& whole, const Window<T>& dwhole) {
  const Call<T>& c = w.c;
  const int64_t h = hk * c.G + g, row0 = ((n * c.Hkv + hk) * c.G + g) * c.Tq + qs;
  const int64_t ks = vis[0], nk = vis[1] - vis[0], r0 = vis[2], nr = vis[3] - vis[2];
  Window<T> win, dw;
  visit_windows(w, b, n, h, qs, vis, skew, whole, dwhole, win, dw);
  scores(c, n, hk, g, qs, vis, b.s.data(), nk, b.t.data(), win, &b.kpanels, skew);
  probabilities_from_lse(w, b.s.data(), row0 + r0, nr, nk);
  const T* dop = w.o.dout.at(n, hk, g, qs + r0);
  // dP = dO V^T (rows x keys)
  times_keys<T>(c.register_tiles, &b.vpanels, nr, ks, vis[1], c.Dv, T(1), dop, w.o.dout.ld(),
                c.v.at(n, hk, 0, ks), c.v.ld(), b.dp.data(), nk);
  const T* pv = dropped(c, b, n, h, qs, vis);
  // dV += P^T dO
  gemm<T>(c.register_tiles, true, false, nk, c.Dv, nr, T(1), pv, nk, dop, w.o.dout.ld(), T(1),
          kg.dv + (ks - kg.k0) * kg.lv, kg.lv);
  score_grads(w, b, n, hk, g, qs, vis, row0, skew, dw);
  if (w.position && skew) {
    skew_backward(c, n, h, qs, vis, b.dsp.data() + b.kPad, b.ldp, b.qvc.data(), w.o.dqv, b.denc);
  } else if (w.position && whole.p == nullptr) {
    dw.backward(c, n, h, qs, w.o.dqv, b.denc);
  }
  // dQ += scale dS K, dK += scale dS^T Q
  gemm<T>(c.register_tiles, false, false, nr, c.Dk, nk, T(c.scale), b.dp.data(), nk,
          c.k.at(n, hk, 0, ks), c.k.ld(), T(1), b.dqa.data() + r0 * c.Dk, c.Dk);
  gemm<T>(c.register_tiles, true, false, nk, c.Dk, nr, T(c.scale), b.dp.data(), nk,
          c.q.at(n, hk, g, qs + r0), c.q.ld(), T(1), kg.dk + (ks - kg.k0) * kg.lk, kg.lk);
}

// Query head g over query block qb: its keys packed, the position term's block window, every
// visit, then the block's rows of dq.
template <typename T>
void block_backward(Backward<T>& w, BackwardBuffers<T>& b, const KeyGrads<T>& kg, int64_t n,
                    int64_t hk, int64_t g, int64_t qb, const void* matrix, void* matrix_rows) {
  const Call<T>& c = w.c;
  const int64_t h = hk * c.G + g, qs = qb * c.bq, rows = std::min(c.bq, c.Tq - qs);
  std::fill(b.dqa.begin(), b.dqa.end(), T(0));
#if defined(ATTNKIT_MATRIX_UNIT)
  const auto* m = static_cast<const MatrixBackward*>(matrix);
  auto* mr = static_cast<MatrixRowsBackward*>(matrix_rows);
  if constexpr (std::is_same_v<T, float>) {
    if (m != nullptr) block_rows_bf16(w, *mr, n, hk, g, qs, rows);
  }
#else
  (void)matrix, (void)matrix_rows;
#endif
  if (matrix == nullptr) {
    pack_keys(c, c.k, c.Dk, n, hk, qb, rows, b.kpanels);
    pack_keys(c, c.v, c.Dv, n, hk, qb, rows, b.vpanels);
  }
  const bool skew = skew_block(c, qb);
  // The position product, and its gradient (dwhole: the same window in dpos), unless the
  // block's term and its gradients are skewed products.
  const Window<T> whole = skew ? Window<T>() : block_window(c, qb, b.pos.data());
  Window<T> dwhole = whole;
  if (whole.p != nullptr) {
    whole.compute(c, n, h, qs);
    dwhole.p = b.dpos.data();
    if (w.position) std::fill(b.dpos.begin(), b.dpos.begin() + rows * whole.width, T(0));
  }
  if (skew && w.o.denc != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = c.qv.at(n, h, 0, qs + r);
      std::copy(src, src + c.Dh, b.qvc.data() + r * c.Dh);
    }
  }
  for (int64_t vi = c.off[qb]; vi < c.off[qb + 1]; ++vi) {
#if defined(ATTNKIT_MATRIX_UNIT)
    if constexpr (std::is_same_v<T, float>) {
      if (m != nullptr) {
        visit_backward_bf16(w, b, kg, *m, *mr, n, hk, g, qs, c.visits + vi * 6, skew, whole,
                            dwhole);
        continue;
      }
    }
#endif
    visit_backward(w, b, kg, n, hk, g, qs, c.visits + vi * 6, skew, whole, dwhole);
  }
  if (w.position && whole.p != nullptr) dwhole.backward(c, n, h, qs, w.o.dqv, b.denc);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(b.dqa.begin() + r * c.Dk, b.dqa.begin() + (r + 1) * c.Dk,
              w.o.dq.at(n, hk, g, qs + r));
  }
}

// The threads' shares of enc's gradient: their rows that are rows of enc, into denc.
template <typename T>
void sum_denc(Backward<T>& w) {
  const Call<T>& c = w.c;
  const int64_t e0 = std::max<int64_t>(0, c.dfirst), e1 = std::min(c.P, c.dfirst + c.drows);
  const int64_t per_head = std::max<int64_t>(0, e1 - e0);
  parallel(0, c.Hkv * c.G * per_head, 64, [&](int64_t begin, int64_t end) {
    for (const auto& own : w.denc_threads) {
      if (own.empty()) continue;
      for (int64_t x = begin; x < end; ++x) {
        const int64_t h = x / per_head, e = e0 + x % per_head;
        T* to = w.o.denc + h * w.o.dhs[0] + e * w.o.dhs[1];
        const T* from = own.data() + (h * c.drows + e - c.dfirst) * c.Dh;
        for (int64_t d = 0; d < c.Dh; ++d) to[d] += from[d];
      }
    }
  });
}

// The other threads' buffers of a shared dbias, into dbias.
template <typename T>
void sum_dbias(Backward<T>& w) {
  parallel(0, w.o.dbias_numel, 4096, [&](int64_t begin, int64_t end) {
    for (const auto& part : w.dbias_parts) {
      for (int64_t x = begin; x < end; ++x) w.o.dbias[x] += part[x];
    }
  });
}

// The stretches' buffers of dk and dv, into dk and dv.
template <typename T>
void sum_dkdv(Backward<T>& w) {
  const Call<T>& c = w.c;
  const QueryStretches& st = w.st;
  parallel(0, c.N * c.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / c.Hkv, hk = nh % c.Hkv;
      zero_rows(w.o.dk, n, hk, 0, c.Tk, c.Dk);
      zero_rows(w.o.dv, n, hk, 0, c.Tk, c.Dv);
      for (int64_t p = 0; p < st.parts; ++p) {
        const auto& bk = w.dk_parts[nh * st.parts + p];
        const auto& bv = w.dv_parts[nh * st.parts + p];
        if (bk.empty()) continue;
        for (int64_t j = 0; j < st.kmax[p] - st.kmin[p]; ++j) {
          T* rk = w.o.dk.at(n, hk, 0, st.kmin[p] + j);
          T* rv = w.o.dv.at(n, hk, 0, st.kmin[p] + j);
          for (int64_t d = 0; d < c.Dk; ++d) rk[d] += bk[j * c.Dk + d];
          for (int64_t d = 0; d < c.Dv; ++d) rv[d] += bv[j * c.Dv + d];
        }
      }
    }
  });
}

// matrix: a MatrixBackward when the products run on the matrix unit, else null.
template <typename T>
void backward_impl(const Call<T>& c, const Grads<T>& grads, const void* matrix) {
  Backward<T> w(c, grads);
  const int64_t items = c.N * c.Hkv * w.st.parts;
  std::atomic<int64_t> next{0};  // items are claimed one at a time (see claim)
  parallel(0, items, 1, [&](int64_t begin, int64_t) {
    OneBlasThread one;
    BackwardBuffers<T> b(w, begin == 0);
#if defined(ATTNKIT_MATRIX_UNIT)
    MatrixUnitThread unit;
    unit.used = matrix != nullptr;
    MatrixRowsBackward mr;
    void* matrix_rows = &mr;
#else
    void* matrix_rows = nullptr;
#endif
    for (int64_t item = claim(next); item < items; item = claim(next)) {
      const int64_t nh = item / w.st.parts, p = item % w.st.parts;
      const int64_t n = nh / c.Hkv, hk = nh % c.Hkv;
      zero_item_rows(w, n, hk, p);
      if (w.st.kmax[p] <= w.st.kmin[p]) continue;
      const KeyGrads<T> kg = key_grads(w, item, n, hk, p);
#if defined(ATTNKIT_MATRIX_UNIT)
      if constexpr (std::is_same_v<T, float>) {
        if (matrix != nullptr) item_grads_bf16(c, mr, kg, w.st.kmin[p], w.st.kmax[p], true);
      }
#endif
      for (int64_t g = 0; g < c.G; ++g) {
        for (int64_t qb = w.st.first[p]; qb < w.st.first[p + 1]; ++qb) {
          block_backward(w, b, kg, n, hk, g, qb, matrix, matrix_rows);
        }
      }
#if defined(ATTNKIT_MATRIX_UNIT)
      if constexpr (std::is_same_v<T, float>) {
        if (matrix != nullptr) item_grads_bf16(c, mr, kg, w.st.kmin[p], w.st.kmax[p], false);
      }
#endif
    }
    if (!b.own_dbias.empty()) {
      std::lock_guard<std::mutex> lock(w.dbias_lock);
      w.dbias_parts.push_back(std::move(b.own_dbias));
    }
  });
  if (grads.denc != nullptr) sum_denc(w);
  if (!w.dbias_parts.empty()) sum_dbias(w);
  if (w.st.parts > 1) sum_dkdv(w);
}

}  // namespace

// Zeros laid out as x where x is dense (at::zeros_like's memory format), else contiguous.
at::Tensor zeros_laid_out_as(const at::Tensor& x) {
  at::Tensor t = x.is_non_overlapping_and_dense()
                     ? at::Tensor(at::detail::empty_strided_cpu(x.sizes(), x.strides(), x.options()))
                     : empty(x.sizes(), x.options());
  t.zero_();
  return t;
}

// A (N, Hkv, T, D) tensor like k or v: token-major when it is, else contiguous. (The operators'
// fake kernels lay their outputs out the same way.)
at::Tensor like_kv(const at::Tensor& k, c10::optional<at::ScalarType> dtype) {
  const auto options = k.options().dtype(dtype.value_or(k.scalar_type()));
  const bool token_major = k.size(2) > 1 && k.stride(2) >= k.size(1) * k.size(3);
  if (!token_major) return empty(k.sizes(), options);
  return empty({k.size(0), k.size(2), k.size(1), k.size(3)}, options).permute({0, 2, 1, 3});
}


std::vector<at::Tensor> backward(const CallArgs& given, const BackwardArgs& b) {
  CallArgs a = given;
  TORCH_CHECK(a.q.dim() == 5 && a.k.dim() == 4 && a.v.dim() == 4,
              "attnkit: q must be (N, Hkv, G, Tq, Dk) and k, v (N, Hkv, Tk, D)");
  TORCH_CHECK((a.k.scalar_type() == a.q.scalar_type() ||
               (a.q.scalar_type() == at::kFloat && a.k.scalar_type() == at::kBFloat16)) &&
                  a.v.scalar_type() == a.k.scalar_type(),
              "attnkit: the backward takes q, k and v of one dtype (or float32 q with bfloat16 "
              "k and v), got ", a.q.scalar_type(), ", ", a.k.scalar_type(), " and ",
              a.v.scalar_type());
  // bfloat16 keys and values: their products on the matrix unit where the CPU has one and the
  // queries and output gradient are bfloat16 numbers too (a bfloat16 call's); the kernel
  // otherwise computes in float32 on converted copies. Their gradients come in q's dtype.
#if defined(ATTNKIT_MATRIX_UNIT)
  std::optional<MatrixBackward> matrix;
#endif
  if (a.k.scalar_type() != a.q.scalar_type()) {
    const at::Tensor k16 = a.k, v16 = a.v;
    a.k = a.k.to(a.q.scalar_type());
    a.v = a.v.to(a.q.scalar_type());
#if defined(ATTNKIT_MATRIX_UNIT)
    const auto k_rows = rows_of<const at::BFloat16*>(k16, k16.data_ptr<at::BFloat16>());
    const auto v_rows = rows_of<const at::BFloat16*>(v16, v16.data_ptr<at::BFloat16>());
    const int64_t N = a.q.size(0), Hkv = a.q.size(1), Tk = k16.size(2);
    if (a.register_tiles && a.q.size(3) > 0 && Tk > 0 && has_bf16_products() &&
        PackedRows::fits(k_rows, k16.size(3)) && PackedRows::fits(v_rows, v16.size(3)) &&
        bf16_numbers(a.q) && bf16_numbers(b.dout)) {
      matrix.emplace(MatrixBackward{PackedRows(k_rows, N, Hkv, Tk, k16.size(3), true),
                                    PackedRows(v_rows, N, Hkv, Tk, v16.size(3), true),
                                    PackedRows(k_rows, N, Hkv, Tk, k16.size(3), false)});
      PackedRows::pack_all({&matrix->kt, &matrix->vt, &matrix->kp});
    }
#endif
  }
  const at::Tensor &q = a.q, &k = a.k, &v = a.v;
  const std::vector<int64_t> rows = {q.size(0), q.size(1), q.size(2), q.size(3)};
  TORCH_CHECK(
      b.lse.sizes() == rows && b.delta.sizes() == rows && b.lse.is_contiguous() &&
          b.delta.is_contiguous() && b.lse.scalar_type() == q.scalar_type() &&
          b.delta.scalar_type() == q.scalar_type(),
      "attnkit: lse and delta must be contiguous (N, Hkv, G, Tq) tensors of q's dtype, got ",
      b.lse.sizes(), " and ", b.delta.sizes());
  TORCH_CHECK(b.dout.dim() == 5 && b.dout.size(0) == q.size(0) && b.dout.size(1) == q.size(1) &&
                  b.dout.size(2) == q.size(2) && b.dout.size(3) == q.size(3) &&
                  b.dout.size(4) == v.size(3) && b.dout.scalar_type() == q.scalar_type(),
              "attnkit: dout must be (N, Hkv, G, Tq, Dv) of q's dtype, got ", b.dout.sizes());
  // dq, dk, dv: where the caller gives them (q's, k's and v's own shapes and dtype, rows
  // contiguous), else laid out as the inputs are (token-major or contiguous), so that the
  // caller's transpose back is free. The kernel writes every element.
  at::Tensor dq = b.dq, dk = b.dk, dv = b.dv;
  if (!dq.defined()) {
    dq = like_q(q, q.size(4));
    dk = like_kv(k);
    dv = like_kv(v);
  } else {
    const at::Tensor* given[3] = {&dq, &dk, &dv};
    const at::Tensor* like[3] = {&q, &k, &v};
    for (int x = 0; x < 3; ++x) {
      TORCH_CHECK(given[x]->defined() && given[x]->sizes() == like[x]->sizes() &&
                      given[x]->scalar_type() == like[x]->scalar_type() &&
                      (given[x]->stride(-1) == 1 || given[x]->size(-1) <= 1),
                  "attnkit: dq, dk and dv must have q's, k's and v's shapes and dtype, with "
                  "contiguous rows");
    }
  }
  at::Tensor dbias;
  int64_t ds[5] = {0, 0, 0, 0, 0};
  int64_t dbias_base = 0;
  if (b.bias_grad) {
    TORCH_CHECK(a.bias.has_value(), "attnkit: bias_grad without a bias");
    dbias = zeros(a.bias->sizes(), q.options());  // the bias's shape, not the scores'
    if (a.bias_layout.empty()) {
      TORCH_CHECK(dbias.dim() == 5, "attnkit: a dense bias is 5-d");
      for (int d = 0; d < 5; ++d) ds[d] = dbias.size(d) == 1 ? 0 : dbias.stride(d);
    } else {
      TORCH_CHECK(a.bias_layout.size() == 6, "attnkit: a bias layout is 5 strides and a base");
      for (int d = 0; d < 5; ++d) ds[d] = a.bias_layout[d];
      dbias_base = a.bias_layout[5];
    }
  }
  const bool position = a.qv.has_value() && a.enc.has_value();
  at::Tensor dqv, denc;
  // dqv laid out as qv (token-major or contiguous; every row is written), denc as enc, so that
  // the caller's transposes back are free.
  if (position && b.qv_grad) dqv = like_kv(*a.qv);
  if (position && b.enc_grad) denc = zeros_laid_out_as(*a.enc);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnkit::native_backward", [&] {
    using T = scalar_t;
    Call<T> c = make_call<T>(a);
    const auto tables = skew_table(c, a.enc);  // kept alive while the kernel reads them
    Grads<T> g;
    g.dout = rows_of<const T*>(b.dout, b.dout.data_ptr<T>());
    g.lse = b.lse.data_ptr<T>();
    g.delta = b.delta.data_ptr<T>();
    g.dq = rows_of<T*>(dq, dq.data_ptr<T>());
    g.dk = rows_of<T*>(dk, dk.data_ptr<T>());
    g.dv = rows_of<T*>(dv, dv.data_ptr<T>());
    if (b.bias_grad) {
      g.dbias = dbias.data_ptr<T>();
      std::copy(ds, ds + 5, g.ds);
      g.dbias_numel = dbias.numel();
      g.dbias_base = dbias_base;
    }
    if (dqv.defined()) g.dqv = rows_of<T*>(dqv, dqv.data_ptr<T>());
    if (denc.defined()) {
      g.denc = denc.data_ptr<T>();
      g.dhs[0] = denc.stride(0);
      g.dhs[1] = denc.stride(1);
    }
    const void* m = nullptr;
#if defined(ATTNKIT_MATRIX_UNIT)
    if (matrix) m = &*matrix;
#endif
    backward_impl<T>(c, g, m);
  });
  // Gradients not asked for are undefined (the operators return them as empty tensors).
  return {dq, dk, dv, dbias, dqv, denc};
}

}  // namespace attnkit
