// Attention of one query per sequence over its keys where they lie in a paged cache (model/paged.py): what a
// decode step of the token-level engine asks of every attention layer.
//
// Why a kernel of our own: read through torch, each layer first gathers every sequence's blocks into one
// padded tensor (an index copy of the whole context, per layer and step) and then runs SDPA over it with a
// mask for the padding; with 32 sequences that gather alone was 13-21% of a serving step. Here each
// (sequence, key head) task reads its keys and values in place, block by block, once for all the query
// heads that share them, and stops at the sequence's own length: no copy, no padding, no mask.
//
// The cache is read through its strides (only each key's own channels must be contiguous), so a static cache
// [batch, kv_heads, capacity, d] viewed as [batch, capacity, kv_heads, d] is a paged one of one block per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "lanes.h"

namespace {

using namespace ster_kernels;

#if STER_KERNELS_ISA
template <class V>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& table,
            const at::Tensor& starts, const at::Tensor& ends, double scale, at::Tensor& out) {
  using T = typename V::T;
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block = keys.size(1), kv_heads = keys.size(2), dv = values.size(3), width = table.size(1);
  const int64_t kb = keys.stride(0), kt = keys.stride(1), kh = keys.stride(2);
  const int64_t vb = values.stride(0), vt = values.stride(1), vh = values.stride(2);
  const int64_t group = heads / kv_heads;
  const T* qs = q.data_ptr<T>();
  const T* ks = keys.data_ptr<T>();
  const T* vs = values.data_ptr<T>();
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* last = ends.data_ptr<int64_t>();
  T* os = out.data_ptr<T>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, g = task % kv_heads;
      const int64_t from = first[i], count = last[i] - first[i];
      scores.resize(group * count);
      acc.assign(group * dv, 0.f);
      const T* qi = qs + (i * heads + g * group) * d;
      for (int64_t p = 0; p < count; ++p) {
        const int64_t at = from + p;
        const T* k = ks + tab[i * width + at / block] * kb + (at % block) * kt + g * kh;
        for (int64_t j = 0; j < group; ++j) {
          float dot;
          one_row<V, 1, 1>(qi + j * d, k, d, &dot);
          scores[j * count + p] = dot * s;
        }
      }
      std::vector<float> inverse(group);
      for (int64_t j = 0; j < group; ++j) {
        float* row = scores.data() + j * count;
        const float top = *std::max_element(row, row + count);
        inverse[j] = 1.f / exp_shifted(row, count, top);
      }
      for (int64_t p = 0; p < count; ++p) {
        const int64_t at = from + p;
        const T* v = vs + tab[i * width + at / block] * vb + (at % block) * vt + g * vh;
        for (int64_t j = 0; j < group; ++j) {
          const float w = scores[j * count + p];
          float* a = acc.data() + j * dv;
          for (int64_t c = 0; c < dv; ++c) a[c] += w * static_cast<float>(v[c]);
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        T* o = os + (i * heads + g * group + j) * dv;
        const float* a = acc.data() + j * dv;
        for (int64_t c = 0; c < dv; ++c) o[c] = T(a[c] * inverse[j]);
      }
    }
  });
}
#endif

// q [n, heads, d]: one query per sequence; keys [blocks, block_size, kv_heads, d] and values [.., dv] the layer's
// paged cache; table [n, width] each sequence's blocks; the sequence attends positions [starts[i], ends[i]).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& table, const at::Tensor& starts, const at::Tensor& ends, double scale) {
  TORCH_CHECK(STER_KERNELS_ISA, "paged_decode: built without AVX2 or AVX-512");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4 && table.dim() == 2,
              "paged_decode: q [n, heads, d], keys and values [blocks, block_size, kv_heads, width], table [n, width]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged_decode: q, keys and values all f32 or all bf16");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "paged_decode: each key's and value's channels contiguous");
  TORCH_CHECK(table.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && ends.scalar_type() == at::kLong,
              "paged_decode: int64 table, starts and ends");
  const int64_t n = q.size(0), heads = q.size(1), kv_heads = keys.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_decode: query heads a multiple of key heads");
  TORCH_CHECK(keys.size(3) == q.size(2) && values.size(2) == kv_heads && values.size(1) == keys.size(1) &&
                  values.size(0) == keys.size(0), "paged_decode: q, keys and values disagree in shape");
  TORCH_CHECK(table.size(0) == n && starts.numel() == n && ends.numel() == n, "paged_decode: one table row a query");
  const at::Tensor tab = table.contiguous(), first = starts.contiguous(), last = ends.contiguous();
  const int64_t reach = tab.size(1) * keys.size(1);
  const int64_t* f = first.data_ptr<int64_t>();
  const int64_t* l = last.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= f[i] && f[i] < l[i] && l[i] <= reach, "paged_decode: keys [", f[i], ", ", l[i],
                ") outside the ", reach, " slots of the table");
  const int64_t blocks = keys.size(0);
  const int64_t* t = tab.data_ptr<int64_t>();
  for (int64_t e = 0; e < tab.numel(); ++e)
    TORCH_CHECK(0 <= t[e] && t[e] < blocks, "paged_decode: block ", t[e], " outside the cache's ", blocks);
  at::Tensor out = at::empty({n, heads, values.size(3)}, q.options());
#if STER_KERNELS_ISA
  const at::Tensor qc = q.contiguous();
  if (q.scalar_type() == at::kFloat)
    attend<F32Lanes>(qc, keys, values, tab, first, last, scale, out);
  else
    attend<Bf16Lanes>(qc, keys, values, tab, first, last, scale, out);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("paged_decode(Tensor q, Tensor keys, Tensor values, Tensor table, Tensor starts, Tensor ends, float scale)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) { m.impl("paged_decode", &paged_decode); }
