// The gathered kernel's backward (gathered.cpp holds the forward and the call's reading).
//
// Each pair's weight is recomputed from the saved log-sum-exp: p = exp(s - lse), and with
// dp = dO . v_j, ds = p (dp - delta) (times the softcap's derivative). A query's gradient is
// scale * sum_j ds_j k_j, gathered like the forward; a key's and a value's, sum_i ds_i q_i and
// sum_i p_i dO_i, are added into rows that other queries of the same key/value head also add
// to. So the work is split by key/value head, each thread owning its head's dk and dv rows
// whole; where there are fewer heads than threads, a head's queries are split into parts, each
// adding into its own copy of the head's rows, summed at the end.

#pragma once

namespace attnkit {
namespace {

struct Grads {
  const float *dout = nullptr, *lse = nullptr, *delta = nullptr;
  float* dq = nullptr;
};

// One block of queries of one gathered head: per query its visible keys; per (query, head) its
// scaled query row, dO's row, dq's sum, its log-sum-exp and delta.
struct BackBlock {
  Selected sel;
  std::vector<float> qs, dout, dq, lse, delta;
  BackBlock(const Gather& g, int64_t nq)
      : sel(nq, g.W),
        qs(nq * g.G * g.Dk),
        dout(nq * g.G * g.Dv),
        dq(nq * g.G * g.Dk),
        lse(nq * g.G),
        delta(nq * g.G) {}
};

// Queries per block: at most kBlockQueries (and the call's queries), their selections and rows
// within kBlockEntries floats.
int64_t block_queries(const Gather& g) {
  const int64_t per = g.W + g.G * (2 * g.Dk + g.Dv + 2);
  const int64_t most = std::clamp<int64_t>(g.Tq, 1, kBlockQueries);
  return std::clamp<int64_t>(kBlockEntries / std::max<int64_t>(1, per), 1, most);
}

// One (query, head)'s gradients from n (<= kLanes) pairs, their weights p and scores'
// gradients ds: dq += ds_u k_u, dk_u += ds_u qs, dv_u += p_u dO. The key rows were just read
// for the scores: they come from the first-level cache.
template <int VK, int VV, typename X>
inline void piece_grads(const Gather& g, float* dq, const float* qs, const float* dout,
                        const float* p, const float* ds, const X* const* kr, float* const* dkr,
                        float* const* dvr, int64_t n) {
  if constexpr (VK > 0 && VV > 0) {
    Vec dqv[VK], qv[VK], ov[VV];
    for (int e = 0; e < VK; ++e) {
      dqv[e] = Vec::loadu(dq + e * kLanes);
      qv[e] = Vec::loadu(qs + e * kLanes);
    }
    for (int e = 0; e < VV; ++e) ov[e] = Vec::loadu(dout + e * kLanes);
    for (int64_t u = 0; u < n; ++u) {
      const Vec w(ds[u]), pu(p[u]);
      for (int e = 0; e < VK; ++e) {
        dqv[e] = at::vec::fmadd(load_as<float>(kr[u] + e * kLanes), w, dqv[e]);
        at::vec::fmadd(qv[e], w, Vec::loadu(dkr[u] + e * kLanes)).store(dkr[u] + e * kLanes);
      }
      for (int e = 0; e < VV; ++e) {
        at::vec::fmadd(ov[e], pu, Vec::loadu(dvr[u] + e * kLanes)).store(dvr[u] + e * kLanes);
      }
    }
    for (int e = 0; e < VK; ++e) dqv[e].store(dq + e * kLanes);
  } else {
    for (int64_t u = 0; u < n; ++u) {
      add_scaled(dq, ds[u], kr[u], g.Dk);
      add_scaled(dkr[u], ds[u], qs, g.Dk);
      add_scaled(dvr[u], p[u], dout, g.Dv);
    }
  }
}

// Query i's entries e:e+n (0 < n <= kLanes) with every head of the block's gathered head, in one
// pass: the scores and dO . v (one vector of kLanes each), the weights p = exp(s - lse) and
// ds = p (dp - delta) (times the cap's derivative), then the gradients. Lanes past n read entry
// e's rows and get weight 0.
template <int VK, int VV, typename X>
void backward_piece(const Gather& g, BackBlock& bb, const X* kb, const X* vb, float* dk,
                    float* dv, int64_t i, int64_t e, int64_t n) {
  const int32_t* idx = bb.sel.idx.data() + i * g.W + e;
  const X* kr[kLanes];
  const X* vr[kLanes];
  float* dkr[kLanes];
  float* dvr[kLanes];
  for (int u = 0; u < kLanes; ++u) {
    const int64_t j = idx[u < n ? u : 0];
    kr[u] = kb + j * g.Dk;
    vr[u] = vb + j * g.Dv;
    dkr[u] = dk + j * g.Dk;
    dvr[u] = dv + j * g.Dv;
  }
  alignas(64) float p[kLanes], ds[kLanes];
  for (int64_t h = 0; h < g.G; ++h) {
    const int64_t ih = i * g.G + h;
    const float* qs = bb.qs.data() + ih * g.Dk;
    const float* dout = bb.dout.data() + ih * g.Dv;
    const Vec s = g.cap(piece_scores<VK>(qs, kr, 0, g.Dk));
    const Vec dp = piece_scores<VV>(dout, vr, 0, g.Dv);
    Vec pv = (s - Vec(bb.lse[ih])).exp();
    if (n < kLanes) pv = Vec::set(Vec(0.0f), pv, n);
    Vec d = pv * (dp - Vec(bb.delta[ih]));
    if (g.softcap > 0.0f) {
      const Vec th = s * Vec(1.0f / g.softcap);
      d = d * (Vec(1.0f) - th * th);
    }
    pv.store(p);
    d.store(ds);
    piece_grads<VK, VV>(g, bb.dq.data() + ih * g.Dk, qs, dout, p, ds, kr, dkr, dvr, n);
  }
}

// The gradients of queries t0:t0+nq of gathered head c of batch row b: dq written, dk and dv
// (the key/value head's (Tk, D) rows) added to; the pairs walked stretch by stretch as the
// forward walks them, each query's keys of the stretch in pieces of kLanes.
template <int VK, int VV, typename X>
void backward_block(const Gather& g, const Grads& a, const float* q, const X* k, const X* v,
                    int64_t b, int64_t c, int64_t t0, int64_t nq, int64_t span, float* dk,
                    float* dv, BackBlock& bb) {
  const int64_t G = g.G, W = g.W, Dk = g.Dk, Dv = g.Dv;
  const int64_t kv = b * g.Hkv + g.kv_head(c);
  const X* kb = k + kv * g.Tk * Dk;
  const X* vb = v + kv * g.Tk * Dv;
  auto row_of = [&](int64_t i, int64_t h) { return (b * g.H + c * G + h) * g.Tq + t0 + i; };
  for (int64_t i = 0; i < nq; ++i) {
    bb.sel.count[i] = g.visible(b, c, t0 + i, bb.sel.idx.data() + i * W);
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = row_of(i, h), ih = i * G + h;
      for (int64_t e = 0; e < Dk; ++e) bb.qs[ih * Dk + e] = q[r * Dk + e] * g.scale;
      std::copy(a.dout + r * Dv, a.dout + (r + 1) * Dv, bb.dout.data() + ih * Dv);
      bb.lse[ih] = a.lse[r];
      bb.delta[ih] = a.delta[r];
    }
  }
  std::fill(bb.dq.begin(), bb.dq.begin() + nq * G * Dk, 0.0f);
  walk(bb.sel, nq, g.Tk, span, [&](int64_t i, int64_t m0, int64_t m1) {
    const int64_t n = bb.sel.count[i];
    int64_t m = m0;
    for (; m < m1; m += kLanes) {
      backward_piece<VK, VV>(g, bb, kb, vb, dk, dv, i, m, std::min<int64_t>(kLanes, n - m));
    }
    return std::min(m, n);
  });
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t h = 0; h < G; ++h) {
      const float* from = bb.dq.data() + (i * G + h) * Dk;
      float* out = a.dq + row_of(i, h) * Dk;
      for (int64_t e = 0; e < Dk; ++e) out[e] = from[e] * g.scale;
    }
  }
}

template <typename X, int VK, int VV>
void run_backward(const Gather& g, const Held& t, const Grads& a, at::Tensor& dk,
                  at::Tensor& dv) {
  const int64_t heads = g.B * g.Hkv;
  const int64_t threads = at::get_num_threads();
  // Parts per head: enough items for every thread.
  const int64_t parts = std::clamp<int64_t>((threads + heads - 1) / heads, 1, g.Tq);
  const int64_t kd = g.Tk * g.Dk, vd = g.Tk * g.Dv;
  // Part 0 adds into dk and dv themselves, the others into their own rows.
  std::vector<float> own(size_t(heads * (parts - 1) * (kd + vd)), 0.0f);
  const float* q = t.q.data_ptr<float>();
  const X* k = reinterpret_cast<const X*>(t.k.data_ptr());
  const X* v = reinterpret_cast<const X*>(t.v.data_ptr());
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  // (no more than a part's queries: each thread holds one block's buffers)
  const int64_t nq = std::min(block_queries(g), (g.Tq + parts - 1) / parts);
  // A stretch's rows of k, v, dk and dv fill about half the core's own cache.
  const int64_t row = (g.Dk + g.Dv) * int64_t(sizeof(X) + sizeof(float));
  const int64_t span = std::max<int64_t>(kLanes, kStretchBytes / row);
  const int64_t per = g.C / g.Hkv;  // gathered heads per key/value head
  std::atomic<int64_t> next{0};
  const int64_t items = heads * parts;
  parallel(0, items, 1, [&](int64_t, int64_t) {
    BackBlock bb(g, nq);
    for (int64_t item = claim(next); item < items; item = claim(next)) {
      const int64_t head = item / parts, part = item % parts;
      float* kr = dkp + head * kd;
      float* vr = dvp + head * vd;
      if (part > 0) {
        kr = own.data() + (head * (parts - 1) + part - 1) * (kd + vd);
        vr = kr + kd;
      }
      const int64_t b = head / g.Hkv, t0 = g.Tq * part / parts, t1 = g.Tq * (part + 1) / parts;
      for (int64_t c = head % g.Hkv * per; c < (head % g.Hkv + 1) * per; ++c) {
        for (int64_t s = t0; s < t1; s += nq) {
          backward_block<VK, VV, X>(g, a, q, k, v, b, c, s, std::min(nq, t1 - s), span, kr, vr,
                                    bb);
        }
      }
    }
  });
  if (parts == 1) return;
  parallel(0, heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t head = h0; head < h1; ++head) {
      for (int64_t part = 1; part < parts; ++part) {
        const float* src = own.data() + (head * (parts - 1) + part - 1) * (kd + vd);
        float* kr = dkp + head * kd;
        float* vr = dvp + head * vd;
        for (int64_t e = 0; e < kd; ++e) kr[e] += src[e];
        for (int64_t e = 0; e < vd; ++e) vr[e] += src[kd + e];
      }
    }
  });
}

template <typename X>
void run_backward_rows(const Gather& g, const Held& t, const Grads& a, at::Tensor& dk,
                       at::Tensor& dv) {
  if (g.Dk == 4 * kLanes && g.Dv == 4 * kLanes) return run_backward<X, 4, 4>(g, t, a, dk, dv);
  if (g.Dk == 8 * kLanes && g.Dv == 8 * kLanes) return run_backward<X, 8, 8>(g, t, a, dk, dv);
  run_backward<X, 0, 0>(g, t, a, dk, dv);
}

// dq (B, H, Tq, Dk), dk and dv (B, Hkv, Tk, D), all float32; lse and delta (B, H, Tq) as the
// forward and rowsum(dO * O) (less the log-sum-exp's own gradient) give them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gathered_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& keys, const at::Tensor& lse, const at::Tensor& delta,
    const c10::optional<at::Tensor>& key_ok, double scale, double softcap,
    c10::ArrayRef<double> band) {
  Gather g = gather_of(q, k, v, keys, key_ok, scale, softcap, band);
  const Held t(q, k, v, keys, key_ok);
  t.point(g);
  TORCH_CHECK(dout.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat &&
                  delta.scalar_type() == at::kFloat,
              "attnkit::gathered_backward: dout, lse and delta in float32");
  TORCH_CHECK(dout.sizes() == at::IntArrayRef({g.B, g.H, g.Tq, g.Dv}) &&
                  lse.sizes() == at::IntArrayRef({g.B, g.H, g.Tq}) &&
                  delta.sizes() == lse.sizes(),
              "attnkit::gathered_backward: dout ", dout.sizes(), ", lse ", lse.sizes(),
              " and delta ", delta.sizes(), " for q ", q.sizes(), " and v ", v.sizes());
  const at::Tensor dout_c = dout.contiguous(), lse_c = lse.contiguous();
  const at::Tensor delta_c = delta.contiguous();
  at::Tensor dq = empty(q.sizes(), q.options());
  at::Tensor dk = zeros(k.sizes(), q.options());
  at::Tensor dv = zeros(v.sizes(), q.options());
  if (dq.numel() == 0) return {dq, dk, dv};
  Grads a;
  a.dout = dout_c.data_ptr<float>();
  a.lse = lse_c.data_ptr<float>();
  a.delta = delta_c.data_ptr<float>();
  a.dq = dq.data_ptr<float>();
  switch (k.scalar_type()) {
    case at::kBFloat16:
      run_backward_rows<at::BFloat16>(g, t, a, dk, dv);
      break;
    case at::kHalf:
      run_backward_rows<at::Half>(g, t, a, dk, dv);
      break;
    default:
      run_backward_rows<float>(g, t, a, dk, dv);
  }
  return {dq, dk, dv};
}

}  // namespace
}  // namespace attnkit
