// Causal attention of a prompt's queries over the keys before them where a cache holds them (paged, or a static
// cache seen as one block a row, as paged_decode.cpp reads it): what a prefill step asks of each plain
// attention layer.
//
// Why a kernel of our own: torch's CPU flash attention takes a prompt's causal mask as a tensor and computes
// every score, the masked half too; told is_causal instead, it skips that half but ran slower still on
// SmolLM2's heads of 64 (7.7 against 5.4 ms a layer over 490 tokens); this kernel takes 2.4-3.0 ms there. Here a block of query positions, with
// all the query heads that share one key head, walks the key tiles up to its last position only: scores by
// broadcast multiply-adds against the tile transposed, flash attention's online softmax per row, the values
// added into rows kept in f32. Only a block's diagonal tile is masked.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "lanes.h"
#include "shares.h"

namespace {

using namespace ster_kernels;

#if STER_KERNELS_ISA
using Vf = F32Lanes;  // f32 lanes of the widest registers (lanes.h)
constexpr int kTile = 2 * Vf::W;  // keys a tile: two registers of scores a row
constexpr int kScoreRows = 6;     // rows of scores in registers at once: 12 accumulators
constexpr int kValueRows = 4;     // rows of output in registers at once, four registers each: 16 accumulators
constexpr int kValueRegs = 4;
constexpr float kNone = -std::numeric_limits<float>::infinity();

template <class T>
struct Cache {  // one layer's keys and values, strides in elements, and the block tables
  const T* keys; const T* values; const int64_t* table;
  int64_t block, columns, kb, kt, kh, vb, vt, vh;
  const T* key(int64_t r, int64_t p, int64_t g) const {
    return keys + table[r * columns + p / block] * kb + (p % block) * kt + g * kh;
  }
  const T* value(int64_t r, int64_t p, int64_t g) const {
    return values + table[r * columns + p / block] * vb + (p % block) * vt + g * vh;
  }
};

// scores s[R rows][kTile] = q[R rows][d] . kt[d][kTile]
template <int R>
inline void score_rows(const float* q, int64_t d, const float* kt, float* s) {
  typename Vf::Acc acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = Vf::set1(0.f);
  for (int64_t e = 0; e < d; ++e) {
    const auto k0 = Vf::load(kt + e * kTile), k1 = Vf::load(kt + e * kTile + Vf::W);
    for (int m = 0; m < R; ++m) {
      const auto x = Vf::set1(q[m * d + e]);
      acc[m][0] = Vf::madd(acc[m][0], x, k0);
      acc[m][1] = Vf::madd(acc[m][1], x, k1);
    }
  }
  for (int m = 0; m < R; ++m) {
    Vf::store(s + m * kTile, acc[m][0]);
    Vf::store(s + m * kTile + Vf::W, acc[m][1]);
  }
}

// o[R rows][C registers] = o * alpha + p[R rows][n] . v[n][..], the C registers from `at` of each row of dv
template <int R, int C>
inline void add_values(const float* p, const float* v, int64_t n, int64_t dv, int64_t at, const float* alpha,
                       float* o) {
  typename Vf::Acc acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = Vf::mul(Vf::load(o + m * dv + at + c * Vf::W), Vf::set1(alpha[m]));
  for (int64_t k = 0; k < n; ++k) {
    typename Vf::Acc x[C];
    for (int c = 0; c < C; ++c) x[c] = Vf::load(v + k * dv + at + c * Vf::W);
    for (int m = 0; m < R; ++m) {
      const auto w = Vf::set1(p[m * kTile + k]);
      for (int c = 0; c < C; ++c) acc[m][c] = Vf::madd(acc[m][c], w, x[c]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) Vf::store(o + m * dv + at + c * Vf::W, acc[m][c]);
}

template <int R>
inline void add_value_rows(const float* p, const float* v, int64_t n, int64_t dv, const float* alpha, float* o) {
  int64_t at = 0;
  for (; at + kValueRegs * Vf::W <= dv; at += kValueRegs * Vf::W) add_values<R, kValueRegs>(p, v, n, dv, at, alpha, o);
  for (; at < dv; at += Vf::W) add_values<R, 1>(p, v, n, dv, at, alpha, o);
}

struct Scratch {  // one thread's rows, in f32
  std::vector<float> q, o, s, top, total, alpha, kt, v;
  Scratch(int64_t rows, int64_t d, int64_t dv)
      : q(rows * d), o(rows * dv), s(rows * kTile), top(rows), total(rows), alpha(rows), kt(d * kTile), v(kTile * dv) {}
};

struct Item { int64_t r, g, i0, i1; };

// query indices [i0, i1) of sequence r (positions start + i), the `group` query heads of key head g: row m is
// query i0 + m / group, head g * group + m % group. Each row attends positions [lo, its own], lo = 0 or, with a
// window, its position - window + 1. With a soft cap (Gemma 2's), each scaled score s counts as cap tanh(s / cap).
template <class T>
void attend_item(const Cache<T>& c, const T* q, const int64_t* qs, T* out, int64_t heads, int64_t t, const Item& it,
                 int64_t start, int64_t group, int64_t d, int64_t dv, int64_t window, float scale, float softcap,
                 Scratch& w) {
  const int64_t rows = (it.i1 - it.i0) * group;
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = it.i0 + m / group, h = it.g * group + m % group;
    const T* src = q + it.r * qs[0] + h * qs[1] + i * qs[2];
    for (int64_t e = 0; e < d; ++e) w.q[m * d + e] = static_cast<float>(src[e]) * scale;
  }
  std::fill(w.o.begin(), w.o.begin() + rows * dv, 0.f);
  std::fill(w.top.begin(), w.top.begin() + rows, kNone);
  std::fill(w.total.begin(), w.total.begin() + rows, 0.f);
  auto lowest = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; };
  const int64_t first = start + it.i0, last = start + it.i1 - 1;
  for (int64_t k0 = lowest(first) / kTile * kTile; k0 <= last; k0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, last + 1 - k0);
    for (int64_t k = 0; k < kTile; ++k) {
      if (k < n) {
        const T* key = c.key(it.r, k0 + k, it.g);
        const T* value = c.value(it.r, k0 + k, it.g);
        for (int64_t e = 0; e < d; ++e) w.kt[e * kTile + k] = static_cast<float>(key[e]);
        for (int64_t e = 0; e < dv; ++e) w.v[k * dv + e] = static_cast<float>(value[e]);
      } else {
        for (int64_t e = 0; e < d; ++e) w.kt[e * kTile + k] = 0.f;
      }
    }
    int64_t m = 0;
    for (; m + kScoreRows <= rows; m += kScoreRows) score_rows<kScoreRows>(&w.q[m * d], d, w.kt.data(), &w.s[m * kTile]);
    switch (rows - m) {
      case 5: score_rows<5>(&w.q[m * d], d, w.kt.data(), &w.s[m * kTile]); break;
      case 4: score_rows<4>(&w.q[m * d], d, w.kt.data(), &w.s[m * kTile]); break;
      case 3: score_rows<3>(&w.q[m * d], d, w.kt.data(), &w.s[m * kTile]); break;
      case 2: score_rows<2>(&w.q[m * d], d, w.kt.data(), &w.s[m * kTile]); break;
      case 1: score_rows<1>(&w.q[m * d], d, w.kt.data(), &w.s[m * kTile]); break;
      default: break;
    }
    for (m = 0; m < rows; ++m) {  // the online softmax, row by row
      float* s = &w.s[m * kTile];
      const int64_t pos = start + it.i0 + m / group;
      const int64_t from = std::max<int64_t>(lowest(pos) - k0, 0), to = std::min<int64_t>(pos + 1 - k0, kTile);
      const bool whole = from == 0 && to == kTile;
      if (softcap > 0)
        for (int64_t k = from; k < to; ++k) s[k] = std::tanh(s[k] / softcap) * softcap;
      if (!whole) {
        for (int64_t k = 0; k < kTile; ++k)
          if (k < from || k >= to) s[k] = kNone;
      }
      const float top = to > from ? Vf::top(Vf::max(Vf::load(s), Vf::load(s + Vf::W))) : kNone;
      if (top == kNone) {  // no key of this tile is this row's: nothing changes
        std::fill(s, s + kTile, 0.f);
        w.alpha[m] = 1.f;
        continue;
      }
      const float now = std::max(w.top[m], top);
      w.alpha[m] = std::exp(w.top[m] - now);
      w.top[m] = now;
      const auto shift = Vf::set1(now);
      const auto e0 = exp_nonpositive(Vf::sub(Vf::load(s), shift));
      const auto e1 = exp_nonpositive(Vf::sub(Vf::load(s + Vf::W), shift));
      Vf::store(s, e0);
      Vf::store(s + Vf::W, e1);
      if (!whole) {  // masked scores come out of the clamped exp as 1e-38, not 0
        for (int64_t k = 0; k < kTile; ++k)
          if (k < from || k >= to) s[k] = 0.f;
      }
      float sum = 0.f;
      if (whole) {
        sum = Vf::sum(e0) + Vf::sum(e1);
      } else {
        for (int64_t k = 0; k < kTile; ++k) sum += s[k];
      }
      w.total[m] = w.total[m] * w.alpha[m] + sum;
    }
    for (m = 0; m + kValueRows <= rows; m += kValueRows)
      add_value_rows<kValueRows>(&w.s[m * kTile], w.v.data(), n, dv, &w.alpha[m], &w.o[m * dv]);
    switch (rows - m) {
      case 3: add_value_rows<3>(&w.s[m * kTile], w.v.data(), n, dv, &w.alpha[m], &w.o[m * dv]); break;
      case 2: add_value_rows<2>(&w.s[m * kTile], w.v.data(), n, dv, &w.alpha[m], &w.o[m * dv]); break;
      case 1: add_value_rows<1>(&w.s[m * kTile], w.v.data(), n, dv, &w.alpha[m], &w.o[m * dv]); break;
      default: break;
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = it.i0 + m / group, h = it.g * group + m % group;
    T* dst = out + ((it.r * heads + h) * t + i) * dv;
    const float inverse = 1.f / w.total[m];
    for (int64_t e = 0; e < dv; ++e) dst[e] = T(w.o[m * dv + e] * inverse);
  }
}

template <class T>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& table,
            const int64_t* starts, int64_t window, double scale, double softcap, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t kv_heads = keys.size(2), dv = values.size(3), group = heads / kv_heads;
  const Cache<T> c{keys.data_ptr<T>(), values.data_ptr<T>(), table.data_ptr<int64_t>(), keys.size(1), table.size(1),
                   keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2)};
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)};
  // query blocks of about 128 rows (all the query heads of a key head), so a key tile's transposition is
  // shared by enough multiply-adds (64, 48 and 256 rows measured no better on SmolLM2's heads)
  const int64_t span = std::clamp<int64_t>(128 / group, 8, 64);
  std::vector<Item> items;
  std::vector<int64_t> done(1, 0);  // work (rows x keys) in the items before each one
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i0 = 0; i0 < t; i0 += span)
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t i1 = std::min(t, i0 + span), last = starts[r] + i1;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, starts[r] + i0 - window + 1) : 0;
        items.push_back({r, g, i0, i1});
        done.push_back(done.back() + (i1 - i0) * (last - lo));
      }
  const Shares shares(done, at::get_num_threads());
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, shares.parts(), 1, [&](int64_t p0, int64_t p1) {
    Scratch w(span * group, d, dv);
    for (int64_t part = p0; part < p1; ++part)
      for (int64_t k = shares.first(part), stop = shares.first(part + 1); k < stop; ++k)
        attend_item<T>(c, qp, qs, op, heads, t, items[k], starts[items[k].r], group, d, dv, window, s, cap, w);
  });
}
#endif

// q [n, heads, t, d]: t queries of each of n sequences, query i of sequence r at position starts[r] + i; keys
// [blocks, block_size, kv_heads, d] and values [.., dv] a layer's cache holding every position up to each
// sequence's last query; table [n, width] each sequence's blocks. Query i attends positions [lo, its own],
// lo = 0 or, with window > 0, its position - window + 1; softcap: 0, or the cap of each score. Returns
// [n, heads, t, dv].
at::Tensor causal_attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& table, const at::Tensor& starts, int64_t window, double scale,
                         double softcap) {
  TORCH_CHECK(STER_KERNELS_ISA, "causal_attend: built without AVX2 or AVX-512");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && table.dim() == 2,
              "causal_attend: q [n, heads, t, d], keys and values [blocks, block_size, kv_heads, width], table [n, width]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "causal_attend: q, keys and values all f32 or all bf16");
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "causal_attend: each query's, key's and value's channels contiguous");
  TORCH_CHECK(table.scalar_type() == at::kLong && starts.scalar_type() == at::kLong, "causal_attend: int64 table and starts");
  const int64_t n = q.size(0), heads = q.size(1), t = q.size(2), kv_heads = keys.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "causal_attend: query heads a multiple of key heads");
  TORCH_CHECK(keys.size(3) == q.size(3) && values.size(2) == kv_heads && values.size(1) == keys.size(1) &&
                  values.size(0) == keys.size(0), "causal_attend: q, keys and values disagree in shape");
#if STER_KERNELS_ISA
  TORCH_CHECK(values.size(3) % Vf::W == 0, "causal_attend: values a multiple of ", Vf::W, " wide");
#endif
  TORCH_CHECK(table.size(0) == n && starts.numel() == n, "causal_attend: one table row and start a sequence");
  const at::Tensor tab = table.contiguous(), first = starts.contiguous();
  const int64_t* f = first.data_ptr<int64_t>();
  const int64_t reach = tab.size(1) * keys.size(1), blocks = keys.size(0);
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(f[r] >= 0 && f[r] + t <= reach, "causal_attend: positions [", f[r], ", ", f[r] + t,
                ") outside the ", reach, " slots of the table");
  const int64_t* b = tab.data_ptr<int64_t>();
  for (int64_t e = 0; e < tab.numel(); ++e)
    TORCH_CHECK(0 <= b[e] && b[e] < blocks, "causal_attend: block ", b[e], " outside the cache's ", blocks);
  at::Tensor out = at::empty({n, heads, t, values.size(3)}, q.options());
#if STER_KERNELS_ISA
  if (t > 0) {
    if (q.scalar_type() == at::kFloat)
      attend<float>(q, keys, values, tab, f, window, scale, softcap, out);
    else
      attend<c10::BFloat16>(q, keys, values, tab, f, window, scale, softcap, out);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("causal_attend(Tensor q, Tensor keys, Tensor values, Tensor table, Tensor starts, int window, float scale, "
        "float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) { m.impl("causal_attend", &causal_attend); }
