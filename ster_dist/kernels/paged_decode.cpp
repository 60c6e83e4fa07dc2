// Attention of one query per sequence over its keys where they lie in a paged cache (model/paged.py): what a
// decode step of the token-level engine asks of every attention layer.
//
// Why a kernel of our own: read through torch, each layer first gathers every sequence's blocks into one
// padded tensor (an index copy of the whole context, per layer and step) and then runs SDPA over it with a
// mask for the padding; with 32 sequences that gather alone was 13-21% of a serving step. Here each
// sequence's keys and values are read in place, block by block, once for all the query heads that share a
// key head, up to the sequence's own length: no copy, no padding, no mask.
//
// The cache is read through its strides (only each key's own channels must be contiguous), so a static cache
// [batch, kv_heads, capacity, d] viewed as [batch, capacity, kv_heads, d] is a paged one of one block per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "lanes.h"

namespace {

using namespace ster_kernels;

#if STER_KERNELS_ISA
// Keys are read in pieces of at most kPiece positions, counted from each sequence's first key, so where a
// sequence's keys are cut depends on that sequence alone: its output is the same sums in the same order
// whatever shares its step and however many threads run it (a request's logits do not depend on its batch).
// The pieces, not the sequences, are dealt to the threads in equal shares of keys: one long sequence keeps
// every thread busy (flash-decoding's split), and so do sequences of mixed lengths. A piece reads every key
// head of its positions, block by block: in a paged cache those are one contiguous run of memory a block.
constexpr int64_t kPiece = 64;

template <class T>
struct Cache {  // one layer's cache as the kernel reads it (strides in elements)
  const T* keys; const T* values; const int64_t* table;
  int64_t block, width, kb, kt, kh, vb, vt, vh;
};

// the dot products of one key with the `group` query heads that share it (consecutive rows of d elements):
// the key is loaded once for all of them
template <class V>
inline void group_dots(const typename V::T* q, const typename V::T* k, int64_t group, int64_t d, float* out) {
  switch (group) {
    case 1: return one_row<V, 1, 1>(q, k, d, out);
    case 2: return one_row<V, 2, 1>(q, k, d, out);
    case 3: return one_row<V, 3, 1>(q, k, d, out);
    case 4: return one_row<V, 4, 1>(q, k, d, out);
    case 5: return one_row<V, 5, 1>(q, k, d, out);
    case 6: return one_row<V, 6, 1>(q, k, d, out);
    case 7: return one_row<V, 7, 1>(q, k, d, out);
    case 8: return one_row<V, 8, 1>(q, k, d, out);
    default:
      for (int64_t j = 0; j < group; ++j) one_row<V, 1, 1>(q + j * d, k, d, out + j);
  }
}

// fn(p, key or value of position lo + p, key head g) over positions [lo, hi) of sequence i, a block at a time
template <class T, class Fn>
inline void each_position(const T* base, int64_t bs, int64_t ts, int64_t hs, int64_t kv_heads, const Cache<T>& c,
                          int64_t i, int64_t lo, int64_t hi, Fn fn) {
  for (int64_t at = lo; at < hi;) {
    const int64_t slot = at % c.block, here = std::min(c.block - slot, hi - at);
    const T* run = base + c.table[i * c.width + at / c.block] * bs + slot * ts;
    for (int64_t s = 0; s < here; ++s)
      for (int64_t g = 0; g < kv_heads; ++g) fn(at - lo + s, run + s * ts + g * hs, g);
    at += here;
  }
}

// positions [lo, hi) of sequence i for its query heads q [heads, d]: per head, the largest scaled score (top
// [heads]), the sum of exp(score - top) (total [heads]) and the values weighted by those exps (acc [heads, dv],
// unnormalised); scores: room for [heads, kPiece]
template <class V>
void piece(const Cache<typename V::T>& c, const typename V::T* q, int64_t i, int64_t lo, int64_t hi, int64_t heads,
           int64_t kv_heads, int64_t d, int64_t dv, float scale, float* scores, float* top, float* total, float* acc) {
  using T = typename V::T;
  const int64_t count = hi - lo, group = heads / kv_heads;
  float dots[8];
  std::vector<float> many(group > 8 ? group : 0);
  float* dot = group > 8 ? many.data() : dots;
  each_position(c.keys, c.kb, c.kt, c.kh, kv_heads, c, i, lo, hi, [&](int64_t p, const T* k, int64_t g) {
    group_dots<V>(q + g * group * d, k, group, d, dot);
    for (int64_t j = 0; j < group; ++j) scores[(g * group + j) * count + p] = dot[j] * scale;
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores + h * count;
    top[h] = *std::max_element(row, row + count);
    total[h] = exp_shifted(row, count, top[h]);
  }
  std::fill(acc, acc + heads * dv, 0.f);
  each_position(c.values, c.vb, c.vt, c.vh, kv_heads, c, i, lo, hi, [&](int64_t p, const T* v, int64_t g) {
    for (int64_t j = g * group; j < (g + 1) * group; ++j) {
      const float w = scores[j * count + p];
      float* a = acc + j * dv;
      for (int64_t e = 0; e < dv; ++e) a[e] += w * static_cast<float>(v[e]);
    }
  });
}

template <class V>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& table,
            const at::Tensor& starts, const at::Tensor& ends, double scale, at::Tensor& out) {
  using T = typename V::T;
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = keys.size(2), dv = values.size(3);
  const Cache<T> c{keys.data_ptr<T>(), values.data_ptr<T>(), table.data_ptr<int64_t>(), keys.size(1), table.size(1),
                   keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2)};
  const T* qs = q.data_ptr<T>();
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* last = ends.data_ptr<int64_t>();
  T* os = out.data_ptr<T>();
  const float s = static_cast<float>(scale);

  // the pieces, sequence by sequence; a sequence of several pieces keeps each one's partial softmax in
  // `partial` ([heads, dv + 2] floats: acc, then top and total) until they are merged
  struct Piece { int64_t i, lo, hi, slot; };
  std::vector<Piece> pieces;
  std::vector<int64_t> done(1, 0);  // keys in the pieces before each one
  int64_t slots = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t cut = (last[i] - first[i] + kPiece - 1) / kPiece;
    for (int64_t k = 0; k < cut; ++k) {
      const int64_t lo = first[i] + k * kPiece, hi = std::min(lo + kPiece, last[i]);
      pieces.push_back({i, lo, hi, cut > 1 ? slots++ : -1});
      done.push_back(done.back() + hi - lo);
    }
  }
  const int64_t stride = heads * (dv + 2);
  std::vector<float> partial(slots * stride);
  const int64_t all = done.back();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (int64_t)pieces.size()));
  auto first_piece = [&](int64_t key) {  // the first piece that starts at or after this key
    return std::lower_bound(done.begin(), done.end() - 1, key) - done.begin();
  };
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores(heads * kPiece), own(stride);
    for (int64_t part = p0; part < p1; ++part)
      for (int64_t k = first_piece(all * part / parts), stop = first_piece(all * (part + 1) / parts); k < stop; ++k) {
        const Piece& pc = pieces[k];
        float* to = pc.slot >= 0 ? partial.data() + pc.slot * stride : own.data();
        piece<V>(c, qs + pc.i * heads * d, pc.i, pc.lo, pc.hi, heads, kv_heads, d, dv, s, scores.data(),
                 to + heads * dv, to + heads * dv + heads, to);
        if (pc.slot >= 0) continue;
        for (int64_t h = 0; h < heads; ++h) {
          T* o = os + (pc.i * heads + h) * dv;
          const float inverse = 1.f / to[heads * dv + heads + h];
          for (int64_t e = 0; e < dv; ++e) o[e] = T(to[h * dv + e] * inverse);
        }
      }
  });
  // sequences of several pieces: their partial softmaxes merged in piece order
  std::vector<float> sum(dv);
  for (size_t k = 0; k < pieces.size();) {
    size_t e = k + 1;
    while (e < pieces.size() && pieces[e].i == pieces[k].i) ++e;
    for (int64_t h = 0; pieces[k].slot >= 0 && h < heads; ++h) {
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (size_t m = k; m < e; ++m) top = std::max(top, partial[pieces[m].slot * stride + heads * dv + h]);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (size_t m = k; m < e; ++m) {
        const float* part = partial.data() + pieces[m].slot * stride;
        const float w = std::exp(part[heads * dv + h] - top);
        total += w * part[heads * dv + heads + h];
        for (int64_t x = 0; x < dv; ++x) sum[x] += w * part[h * dv + x];
      }
      T* o = os + (pieces[k].i * heads + h) * dv;
      for (int64_t x = 0; x < dv; ++x) o[x] = T(sum[x] / total);
    }
    k = e;
  }
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
