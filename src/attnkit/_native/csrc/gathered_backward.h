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

// The products walk each query's pairs in pieces of kPiece keys, and every head of a gathered
// head takes a piece before the next piece: its rows are read from memory for the first head
// and from the core's nearest cache for the others.
constexpr int64_t kPiece = 64;

// One block of queries' buffers (of one gathered head): per query its visible keys, per
// (query, head) its scores (then weights) and its scaled query row.
struct Block {
  Selected sel;
  std::vector<float> s, qs;
  Block(const Gather& g, int64_t nq) : sel(nq, g.W), s(nq * g.G * g.W), qs(nq * g.G * g.Dk) {}
};

// Queries per block: at most kBlockQueries, their scores within kBlockEntries floats.
int64_t block_queries(const Gather& g) {
  return std::clamp<int64_t>(kBlockEntries / std::max<int64_t>(1, g.G * g.W), 1, kBlockQueries);
}

// The products of query i's rows (one a head: `rows` holds (query, head) rows of d elements)
// with its selected rows m0:m1 of `base`: out[(i G + h) W + m] = rows_ih . base_idx[m]. The
// scores (q scaled, k), or dO . v. Rows of VD vectors, a constant where the instantiation
// fixes it (0: any length). No prefetching: within a stretch most rows are already in the
// core's cache, and fetching each row's lines ahead cost more instructions than it saved.
template <int VD, typename X>
void dots_run(const Gather& g, const Block& blk, const float* rows, int64_t d, const X* base,
              float* out, int64_t i, int64_t m0, int64_t m1) {
  const int64_t G = g.G, W = g.W;
  const int32_t* idx = blk.sel.idx.data() + i * W;
  for (int64_t p0 = m0; p0 < m1; p0 += kPiece) {
    const int64_t p1 = std::min(p0 + kPiece, m1);
    for (int64_t h = 0; h < G; ++h) {
      const float* q = rows + (i * G + h) * d;
      float* o = out + (i * G + h) * W;
      int64_t m = p0;
      if constexpr (VD > 0) {
        Vec qv[VD];
        for (int v = 0; v < VD; ++v) qv[v] = Vec::loadu(q + v * kLanes);
        for (; m + kLanes <= p1; m += kLanes) {
          Vec part[kLanes];
          for (int u = 0; u < kLanes; ++u) {
            const X* row = base + idx[m + u] * d;
            Vec acc = load_as<float>(row) * qv[0];
            for (int v = 1; v < VD; ++v) {
              acc = at::vec::fmadd(load_as<float>(row + v * kLanes), qv[v], acc);
            }
            part[u] = acc;
          }
          sums(part).store(o + m);
        }
      }
      for (; m < p1; ++m) {
        o[m] = dot(q, base + idx[m] * d, d);
      }
    }
  }
}

struct Grads {
  const float *dout = nullptr, *lse = nullptr, *delta = nullptr;
  float* dq = nullptr;
};

// A block of queries' buffers beyond the forward's: per (query, head) the weights p, the
// products dO . v then the scores' gradients ds, dO's row and dq's.
struct BackBlock {
  Block blk;
  std::vector<float> p, ds, dout, dq;
  BackBlock(const Gather& g, int64_t nq)
      : blk(g, nq),
        p(nq * g.G * g.W),
        ds(nq * g.G * g.W),
        dout(nq * g.G * g.Dv),
        dq(nq * g.G * g.Dk) {}
};

// Query i's pairs m0:m1 (every head): dq_ih += ds k_j, dk_j += ds qs_ih, dv_j += p dO_ih.
template <int VK, int VV, typename X>
void grad_run(const Gather& g, BackBlock& bb, const X* kb, float* dk, float* dv, int64_t i,
              int64_t m0, int64_t m1) {
  const int64_t G = g.G, W = g.W, Dk = g.Dk, Dv = g.Dv, n = bb.blk.sel.count[i];
  const int32_t* idx = bb.blk.sel.idx.data() + i * W;
  for (int64_t p0 = m0; p0 < m1; p0 += kPiece) {
    const int64_t p1 = std::min(p0 + kPiece, m1);
    for (int64_t h = 0; h < G; ++h) {
      const int64_t ih = i * G + h;
      const float* qs = bb.blk.qs.data() + ih * Dk;
      const float* dout = bb.dout.data() + ih * Dv;
      const float* ds = bb.ds.data() + ih * W;
      const float* p = bb.p.data() + ih * W;
      float* dq = bb.dq.data() + ih * Dk;
      if constexpr (VK > 0 && VV > 0) {
        Vec qv[VK], dqv[VK], ov[VV];
        for (int e = 0; e < VK; ++e) qv[e] = Vec::loadu(qs + e * kLanes);
        for (int e = 0; e < VK; ++e) dqv[e] = Vec::loadu(dq + e * kLanes);
        for (int e = 0; e < VV; ++e) ov[e] = Vec::loadu(dout + e * kLanes);
        for (int64_t m = p0; m < p1; ++m) {
          if (h == 0 && m + kAhead < n) {
            const int64_t ahead = idx[m + kAhead];
            fetch_row(kb + ahead * Dk, Dk);
            fetch_row(dk + ahead * Dk, Dk, true);
            fetch_row(dv + ahead * Dv, Dv, true);
          }
          const int64_t j = idx[m];
          const Vec w(ds[m]), pw(p[m]);
          const X* krow = kb + j * Dk;
          float* dkrow = dk + j * Dk;
          float* dvrow = dv + j * Dv;
          for (int e = 0; e < VK; ++e) {
            dqv[e] = at::vec::fmadd(load_as<float>(krow + e * kLanes), w, dqv[e]);
            at::vec::fmadd(qv[e], w, Vec::loadu(dkrow + e * kLanes)).store(dkrow + e * kLanes);
          }
          for (int e = 0; e < VV; ++e) {
            at::vec::fmadd(ov[e], pw, Vec::loadu(dvrow + e * kLanes)).store(dvrow + e * kLanes);
          }
        }
        for (int e = 0; e < VK; ++e) dqv[e].store(dq + e * kLanes);
      } else {
        for (int64_t m = p0; m < p1; ++m) {
          const int64_t j = idx[m];
          add_scaled(dq, ds[m], kb + j * Dk, Dk);
          add_scaled(dk + j * Dk, ds[m], qs, Dk);
          add_scaled(dv + j * Dv, p[m], dout, Dv);
        }
      }
    }
  }
}

// The scores' gradients of one (query, head) from its weights p, its products dp = dO . v (in
// ds, replaced) and its capped scores s: ds = p (dp - delta), times the cap's derivative.
inline void score_grads(const Gather& g, const float* s, const float* p, float* ds, int64_t n,
                        float delta) {
  const Vec dv(delta), one(1.0f), inv(g.softcap > 0.0f ? 1.0f / g.softcap : 0.0f);
  int64_t m = 0;
  for (; m + kLanes <= n; m += kLanes) {
    Vec d = Vec::loadu(p + m) * (Vec::loadu(ds + m) - dv);
    if (g.softcap > 0.0f) {
      const Vec th = Vec::loadu(s + m) * inv;
      d = d * (one - th * th);
    }
    d.store(ds + m);
  }
  for (; m < n; ++m) {
    float d = p[m] * (ds[m] - delta);
    if (g.softcap > 0.0f) {
      const float th = s[m] / g.softcap;
      d *= 1.0f - th * th;
    }
    ds[m] = d;
  }
}

// The gradients of queries t0:t0+nq of gathered head c of batch row b: dq written, dk and dv
// (the key/value head's (Tk, D) rows) added to; in the forward's phases, stretch by stretch.
template <int VK, int VV, typename X>
void backward_block(const Gather& g, const Grads& a, const float* q, const X* k, const X* v,
                    int64_t b, int64_t c, int64_t t0, int64_t nq, int64_t span, float* dk,
                    float* dv, BackBlock& bb) {
  const int64_t G = g.G, W = g.W, Dk = g.Dk, Dv = g.Dv;
  Block& blk = bb.blk;
  const int64_t kv = b * g.Hkv + g.kv_head(c);
  const X* kb = k + kv * g.Tk * Dk;
  const X* vb = v + kv * g.Tk * Dv;
  auto row_of = [&](int64_t i, int64_t h) { return (b * g.H + c * G + h) * g.Tq + t0 + i; };
  for (int64_t i = 0; i < nq; ++i) {
    blk.sel.count[i] = g.visible(b, c, t0 + i, blk.sel.idx.data() + i * W);
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = row_of(i, h), ih = i * G + h;
      for (int64_t e = 0; e < Dk; ++e) blk.qs[ih * Dk + e] = q[r * Dk + e] * g.scale;
      std::copy(a.dout + r * Dv, a.dout + (r + 1) * Dv, bb.dout.data() + ih * Dv);
    }
  }
  walk(blk.sel, nq, g.Tk, span, [&](int64_t i, int64_t m0, int64_t m1) {
    dots_run<VK>(g, blk, blk.qs.data(), Dk, kb, blk.s.data(), i, m0, m1);
    return m1;
  });
  walk(blk.sel, nq, g.Tk, span, [&](int64_t i, int64_t m0, int64_t m1) {
    dots_run<VV>(g, blk, bb.dout.data(), Dv, vb, bb.ds.data(), i, m0, m1);
    return m1;
  });
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t h = 0; h < G; ++h) {
      const int64_t n = blk.sel.count[i], ih = i * G + h;
      float* s = blk.s.data() + ih * W;
      float* p = bb.p.data() + ih * W;
      g.cap(s, n);
      std::copy(s, s + n, p);
      // (a row with no key has lse -inf and no pair: nothing to weigh)
      if (n) exp_sum(p, n, a.lse[row_of(i, h)]);
      score_grads(g, s, p, bb.ds.data() + ih * W, n, a.delta[row_of(i, h)]);
    }
  }
  std::fill(bb.dq.begin(), bb.dq.begin() + nq * G * Dk, 0.0f);
  walk(blk.sel, nq, g.Tk, span, [&](int64_t i, int64_t m0, int64_t m1) {
    grad_run<VK, VV>(g, bb, kb, dk, dv, i, m0, m1);
    return m1;
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
  const int64_t nq = block_queries(g);
  // A stretch's rows of k, dk and dv fill about half the core's own cache.
  const int64_t row = g.Dk * int64_t(sizeof(X)) + (g.Dk + g.Dv) * int64_t(sizeof(float));
  const int64_t span = std::max<int64_t>(kPiece, kStretchBytes / row);
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
