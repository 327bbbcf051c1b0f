// The finiteness check of a call's inputs: whether every element of some float tensors is
// finite, in one read of each, shared by threads. float32 and float64 by arithmetic (x * 0 is
// 0 for a finite x), bfloat16 and float16 by their bits (an exponent of all ones is inf or NaN).

#include "kernel.h"
#include "share.h"

namespace attnkit {
namespace {

// acc += x * 0 over n elements from p: x * 0 is 0 for a finite x, NaN for inf or NaN.
template <typename T>
void add_zeros(const T* p, int64_t n, at::vec::Vectorized<T> (&acc)[4], T& tail) {
  using V = at::vec::Vectorized<T>;
  const V zero(T(0));
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    for (int u = 0; u < 4; ++u) acc[u] = at::vec::fmadd(V::loadu(p + j + u * W), zero, acc[u]);
  }
  for (; j + W <= n; j += W) acc[0] = at::vec::fmadd(V::loadu(p + j), zero, acc[0]);
  for (; j < n; ++j) tail += p[j] * T(0);
}

// Whether any of n 16-bit numbers from p has every bit of `exponent` set (inf or NaN).
bool any_exponent_full(const uint16_t* p, int64_t n, uint16_t exponent) {
  uint16_t full = 0;  // a loop the compiler vectorizes: no early exit
  for (int64_t j = 0; j < n; ++j) full |= uint16_t((p[j] & exponent) == exponent);
  return full != 0;
}

template <typename T>
bool all_zero(at::vec::Vectorized<T> (&acc)[4], T tail) {
  using V = at::vec::Vectorized<T>;
  const V sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  return at::vec::vec_reduce_all<T>([](V& a, V& b) { return a + b; }, sum) + tail == T(0);
}

// One tensor as stretches: its dimensions by decreasing stride, size-1 ones dropped and
// neighbours that are one run of memory merged; each stretch is a run of the innermost dimension
// (or one element, when that is not contiguous), cut into pieces of at most kPiece elements.
struct Stretches {
  static constexpr int64_t kPiece = 16384;
  const char* base = nullptr;
  at::ScalarType type;
  std::vector<int64_t> size, stride;  // the outer dimensions
  int64_t len = 1, pieces = 1, count = 1;

  explicit Stretches(const at::Tensor& t)
      : base(static_cast<const char*>(t.data_ptr())), type(t.scalar_type()) {
    // Neither the order of the elements nor their repeats matter: dimensions by decreasing
    // stride, broadcast ones dropped.
    std::vector<int64_t> order;
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) != 1 && t.stride(d) != 0) order.push_back(d);  // stride 0: repeats
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
    std::vector<int64_t> sz, st;
    for (int64_t d : order) {
      if (!sz.empty() && st.back() == t.stride(d) * t.size(d)) {
        sz.back() *= t.size(d);
        st.back() = t.stride(d);
      } else {
        sz.push_back(t.size(d));
        st.push_back(t.stride(d));
      }
    }
    if (!sz.empty() && st.back() == 1) {
      len = sz.back();
      sz.pop_back();
      st.pop_back();
    }
    size = sz;
    stride = st;
    pieces = (len + kPiece - 1) / kPiece;
    for (int64_t x : size) count *= x;
    count *= pieces;
  }

  // Pieces u0:u1 are finite.
  bool finite(int64_t u0, int64_t u1) const {
    switch (type) {
      case at::kDouble: return finite_as<double>(u0, u1);
      case at::kBFloat16: return finite_as<uint16_t>(u0, u1, 0x7f80);
      case at::kHalf: return finite_as<uint16_t>(u0, u1, 0x7c00);
      default: return finite_as<float>(u0, u1);
    }
  }

  // T: float or double, or uint16_t for the bits of a 16-bit float whose exponent is `exponent`.
  template <typename T>
  bool finite_as(int64_t u0, int64_t u1, uint16_t exponent = 0) const {
    const int64_t dims = (int64_t)size.size();
    std::vector<int64_t> idx(dims, 0);
    int64_t row = u0 / pieces, piece = u0 % pieces, off = 0;
    for (int64_t d = dims - 1; d >= 0; --d) {
      idx[d] = row % size[d];
      row /= size[d];
      off += idx[d] * stride[d];
    }
    const T* p = reinterpret_cast<const T*>(base);
    using Acc = std::conditional_t<std::is_same_v<T, uint16_t>, float, T>;
    at::vec::Vectorized<Acc> acc[4] = {Acc(0), Acc(0), Acc(0), Acc(0)};
    Acc tail = 0;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t a = piece * kPiece, n = std::min(kPiece, len - a);
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (any_exponent_full(p + off + a, n, exponent)) return false;
      } else {
        add_zeros(p + off + a, n, acc, tail);
      }
      if (++piece == pieces) {  // the next row: an odometer over the outer dimensions
        piece = 0;
        for (int64_t d = dims - 1; d >= 0; --d) {
          off += stride[d];
          if (++idx[d] < size[d]) break;
          off -= stride[d] * size[d];
          idx[d] = 0;
        }
      }
    }
    return all_zero(acc, tail);
  }
};

}  // namespace

// Whether every element of these float32, float64, bfloat16 or float16 tensors is finite: one
// read of each, shared by threads (share.h; a sum would take a pass per tensor, and overflow past
// 1e38; a reduced-precision one converts first).
bool all_finite(at::TensorList ts) {
  std::vector<Stretches> parts;
  std::vector<int64_t> first = {0};
  for (const auto& t : ts) {
    const auto type = t.scalar_type();
    TORCH_CHECK(type == at::kFloat || type == at::kDouble || type == at::kBFloat16 ||
                    type == at::kHalf,
                "attnkit::all_finite: float32, float64, bfloat16 or float16 CPU tensors, got ",
                type, " on ", t.device());
    TORCH_CHECK(t.device().is_cpu(), "attnkit::all_finite: CPU tensors, got one on ", t.device());
    if (t.numel() == 0) continue;
    parts.emplace_back(t);
    first.push_back(first.back() + parts.back().count);
  }
  // Chunks of at least 8 stretches, a few per thread, claimed one at a time.
  const int64_t total = first.back(), threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(8, (total + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (total + chunk - 1) / chunk;
  std::atomic<bool> ok{true};
  std::atomic<int64_t> next{0};
  auto body = [&] {
    for (int64_t x = claim(next); x < chunks && ok.load(std::memory_order_relaxed);
         x = claim(next)) {
      const int64_t begin = x * chunk, end = std::min(total, begin + chunk);
      for (size_t i = 0; i < parts.size() && ok.load(std::memory_order_relaxed); ++i) {
        const int64_t a = std::max(begin, first[i]), b = std::min(end, first[i + 1]);
        if (a < b && !parts[i].finite(a - first[i], b - first[i])) ok = false;
      }
    }
  };
  share(std::min(threads, (total + 7) / 8) - 1, body);
  return ok.load();
}

}  // namespace attnkit
