// dlm::row_attention: the attention of one new token per row over that row's own cache slots, for the compiled
// one-token step of a row batch (dlm.sampling.graphs.RowsStep) on a CPU.
//
// q (R, Hkv, G, hd): row r's G query heads that share K/V head h; k, v (R, Hkv, S, hd), any strides but a contiguous
// last dim (views of the row batch's per-layer buffers); mask (R, 1, 1, S) bool, true where row r may read slot s;
// -> (R, Hkv, G, hd), softmax(scale * q k^T) v over the allowed slots. K and V are q's dtype, or bfloat16 under
// float32 queries (a row batch's K/V kept in bfloat16: half the bytes to read; each vector is widened to float32 as it
// is loaded, the sums are float32's).
//
// Why a kernel of our own: PyTorch's CPU SDPA kernel reads 16 rows' K/V from memory at about half of what a plain
// read of the same strided slices gets (docs/log/batching.md). Here each (row, K/V head) is two streams: its K rows
// once (G dot products each), its V rows once (G multiply-adds each); slots the mask forbids are never read. Where the
// head dim is 2, 4 or 8 whole vectors and G is 1, 2 or 4 (`head_blocked`), the G queries and the G output rows stay
// in registers across the slots: ~1.9x less arithmetic time than the generic loop, which ar-mid's 16-row step sees
// where its K/V sit in the cache (docs/log/batching.md).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <limits>
#include <vector>

namespace {

using at::vec::Vectorized;

inline Vectorized<float> load(const float* p) { return Vectorized<float>::loadu(p); }
inline Vectorized<double> load(const double* p) { return Vectorized<double>::loadu(p); }
inline Vectorized<float> load(const at::BFloat16* p) {  // K/V kept in bfloat16: widened to float32 as loaded
  Vectorized<float> x;
  at::vec::load_to_float(p, x);
  return x;
}

inline float hsum(const Vectorized<float>& a) { return a.reduce_add(); }
inline double hsum(const Vectorized<double>& a) {
  return at::vec::vec_reduce_all<double>([](Vectorized<double>& x, Vectorized<double>& y) { return x + y; }, a);
}

template <typename T, typename KV>
inline T dot(const T* a, const KV* b, int64_t n) {
  using V = Vectorized<T>;
  constexpr int64_t w = V::size();
  V acc0(T(0)), acc1(T(0));
  int64_t d = 0;
  for (; d + 2 * w <= n; d += 2 * w) {
    acc0 = at::vec::fmadd(V::loadu(a + d), load(b + d), acc0);
    acc1 = at::vec::fmadd(V::loadu(a + d + w), load(b + d + w), acc1);
  }
  for (; d + w <= n; d += w) acc0 = at::vec::fmadd(V::loadu(a + d), load(b + d), acc0);
  T s = hsum(acc0 + acc1);
  for (; d < n; ++d) s += a[d] * T(b[d]);
  return s;
}

template <typename T, typename KV>
inline void axpy(T* y, T p, const KV* x, int64_t n) {  // y += p * x
  using V = Vectorized<T>;
  constexpr int64_t w = V::size();
  const V pv(p);
  int64_t d = 0;
  for (; d + w <= n; d += w) at::vec::fmadd(pv, load(x + d), V::loadu(y + d)).store(y + d);
  for (; d < n; ++d) y[d] += p * T(x[d]);
}

// One (row, K/V head) when the head dim is NV whole vectors and G is small: the G queries and the G output
// accumulators stay in registers, each allowed slot's K and V row is loaded once as NV vectors (the generic loop
// below reloads and stores its accumulators for every slot).
template <typename T, typename KV, int G, int NV>
void head_blocked(const T* qh, int64_t qs2, const KV* kh, int64_t ks2, const KV* vh, int64_t vs2,
                  const int64_t* slots, int64_t n, T scale, T* score, T* oh) {
  using V = Vectorized<T>;
  constexpr int64_t w = V::size();
  V qv[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = V::loadu(qh + g * qs2 + j * w);
  for (int64_t t = 0; t < n; ++t) {  // K: each allowed slot's row once, its G dot products
    const KV* kr = kh + slots[t] * ks2;
    V kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = load(kr + j * w);
    for (int g = 0; g < G; ++g) {
      V a = qv[g][0] * kv[0];
      for (int j = 1; j < NV; ++j) a = at::vec::fmadd(qv[g][j], kv[j], a);
      score[g * n + t] = scale * hsum(a);
    }
  }
  T total[G];
  for (int g = 0; g < G; ++g) {  // softmax over the allowed slots
    T* sg = score + g * n;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, sg[t]);
    at::vec::map([m](V x) { return (x - V(m)).exp(); }, sg, sg, n);
    total[g] = at::vec::reduce_all<T>([](V& a, V& b) { return a + b; }, sg, n);
  }
  V acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = V(T(0));
  for (int64_t t = 0; t < n; ++t) {  // V: each allowed slot's row once, its G multiply-adds
    const KV* vr = vh + slots[t] * vs2;
    V vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load(vr + j * w);
    for (int g = 0; g < G; ++g) {
      const V p(score[g * n + t]);
      for (int j = 0; j < NV; ++j) acc[g][j] = at::vec::fmadd(p, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const V inv(T(1) / total[g]);
    for (int j = 0; j < NV; ++j) (acc[g][j] * inv).store(oh + g * (NV * w) + j * w);
  }
}

// the blocked head for this (G, D), or nullptr: the generic loop
template <typename T, typename KV>
using HeadFn = void (*)(const T*, int64_t, const KV*, int64_t, const KV*, int64_t, const int64_t*, int64_t, T, T*, T*);

template <typename T, typename KV, int G>
HeadFn<T, KV> blocked_for_nv(int64_t nv) {
  switch (nv) {
    case 2: return &head_blocked<T, KV, G, 2>;
    case 4: return &head_blocked<T, KV, G, 4>;
    case 8: return &head_blocked<T, KV, G, 8>;
    default: return nullptr;
  }
}

template <typename T, typename KV>
HeadFn<T, KV> blocked(int64_t G, int64_t D) {
  constexpr int64_t w = Vectorized<T>::size();
  if (D % w) return nullptr;
  switch (G) {
    case 1: return blocked_for_nv<T, KV, 1>(D / w);
    case 2: return blocked_for_nv<T, KV, 2>(D / w);
    case 4: return blocked_for_nv<T, KV, 4>(D / w);
    default: return nullptr;
  }
}

template <typename T, typename KV>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
         at::Tensor& out) {
  const int64_t R = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = k.size(2);
  const T* qp = q.data_ptr<T>();
  const KV* kp = k.data_ptr<KV>();
  const KV* vp = v.data_ptr<KV>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = mask.stride(0), ms3 = mask.stride(3);
  const HeadFn<T, KV> fast = blocked<T, KV>(G, D);
  at::parallel_for(0, R * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> slots(S);
    std::vector<T> score(G * S), acc(G * D), total(G);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r = i / H, h = i % H;
      int64_t n = 0;
      for (int64_t s = 0; s < S; ++s)
        if (mp[r * ms0 + s * ms3]) slots[n++] = s;
      const T* qh = qp + r * qs0 + h * qs1;
      const KV* kh = kp + r * ks0 + h * ks1;
      const KV* vh = vp + r * vs0 + h * vs1;
      T* oh = op + (r * H + h) * G * D;
      if (n == 0) {  // no slot allowed: NaN, as a softmax over nothing
        std::fill(oh, oh + G * D, std::numeric_limits<T>::quiet_NaN());
        continue;
      }
      if (fast) {
        fast(qh, qs2, kh, ks2, vh, vs2, slots.data(), n, T(scale), score.data(), oh);
        continue;
      }
      for (int64_t t = 0; t < n; ++t) {  // K: each allowed slot's row once, its G dot products
        const KV* kr = kh + slots[t] * ks2;
        for (int64_t g = 0; g < G; ++g) score[g * S + t] = T(scale) * dot(qh + g * qs2, kr, D);
      }
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t g = 0; g < G; ++g) {  // softmax over the allowed slots
        T* sg = score.data() + g * S;
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sg[t]);
        at::vec::map([m](Vectorized<T> x) { return (x - Vectorized<T>(m)).exp(); }, sg, sg, n);
        total[g] = at::vec::reduce_all<T>([](Vectorized<T>& a, Vectorized<T>& b) { return a + b; }, sg, n);
      }
      for (int64_t t = 0; t < n; ++t) {  // V: each allowed slot's row once, its G multiply-adds
        const KV* vr = vh + slots[t] * vs2;
        for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, score[g * S + t], vr, D);
      }
      for (int64_t g = 0; g < G; ++g) {
        const T inv = T(1) / total[g];
        for (int64_t d = 0; d < D; ++d) oh[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "row_attention: 4-d tensors");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "row_attention: q (R, Hkv, G, hd) against k, v (R, Hkv, S, hd)");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == q.size(0) && mask.size(1) == 1 && mask.size(2) == 1
              && mask.size(3) == k.size(2), "row_attention: mask (R, 1, 1, S) bool");
  const bool half_kv = q.scalar_type() == at::kFloat && k.scalar_type() == at::kBFloat16;
  TORCH_CHECK((q.scalar_type() == k.scalar_type() || half_kv) && k.scalar_type() == v.scalar_type(),
              "row_attention: K and V of q's dtype, or bfloat16 under float32 q");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "row_attention: contiguous head dims");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (half_kv)
    run<float, at::BFloat16>(q, k, v, mask, scale, out);
  else
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "row_attention", [&] { run<scalar_t, scalar_t>(q, k, v, mask, scale, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dlm, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dlm, CPU, m) { m.impl("row_attention", &row_attention); }
