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
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "entries.h"
#include "lanes.h"
#include "shares.h"

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
constexpr int64_t kAhead = 8;

template <class T>
struct Cache {  // one layer's cache as the kernel reads it (strides in elements)
  const T* keys; const T* values; const int64_t* table;
  int64_t block, columns, kb, kt, kh, vb, vt, vh;  // columns: the table's, blocks a sequence may hold
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
// (base: the keys or the values, bs / ts / hs their strides by block, slot and head, width elements a head)
template <class T, class Fn>
inline void each_position(const T* base, int64_t bs, int64_t ts, int64_t hs, int64_t width, int64_t g0, int64_t g1,
                          const Cache<T>& c, int64_t i, int64_t lo, int64_t hi, Fn fn) {
  // a position kAhead further on is asked of memory now: blocks lie anywhere, so the hardware's prefetcher,
  // which follows one stream within a page, would start each block cold (1.3-1.6x slower on 32 sequences)
  const int64_t row = width * sizeof(T);
  auto fetch = [&](const T* p) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < row; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + g * hs) + b, _MM_HINT_T0);
  };
  for (int64_t at = lo; at < hi;) {
    const int64_t slot = at % c.block, here = std::min(c.block - slot, hi - at);
    const T* run = base + c.table[i * c.columns + at / c.block] * bs + slot * ts;
    const T* next = at + here < hi ? base + c.table[i * c.columns + (at + here) / c.block] * bs : nullptr;
    for (int64_t s = 0; s < here; ++s) {
      if (s + kAhead < here) fetch(run + (s + kAhead) * ts);
      else if (next && s + kAhead - here < std::min(c.block, hi - at - here)) fetch(next + (s + kAhead - here) * ts);
      for (int64_t g = g0; g < g1; ++g) fn(at - lo + s, run + s * ts + g * hs, g);
    }
    at += here;
  }
}

// positions [lo, hi) of sequence i for the query heads of key heads [g0, g1), q [heads, d] being all of its
// query heads: per query head h of those, the largest scaled score (top[h]), the sum of exp(score - top)
// (total[h]) and the values weighted by those exps (acc [heads, dv], unnormalised); scores: room for
// [heads, kPiece]. With a soft cap (Gemma 2's), a scaled score s counts as cap * tanh(s / cap), as Attention._attend
// caps them before the softmax.
template <class V>
void piece(const Cache<typename V::T>& c, const typename V::T* q, int64_t i, int64_t lo, int64_t hi, int64_t g0,
           int64_t g1, int64_t group, int64_t d, int64_t dv, float scale, float softcap, float* scores, float* top,
           float* total, float* acc) {
  using T = typename V::T;
  const int64_t count = hi - lo;
  float dots[8];
  thread_local std::vector<float> many;  // a thread's room for a group of more than 8 dots, kept between calls
  if (group > 8 && (int64_t)many.size() < group) many.resize(group);
  float* dot = group > 8 ? many.data() : dots;
  each_position(c.keys, c.kb, c.kt, c.kh, d, g0, g1, c, i, lo, hi, [&](int64_t p, const T* k, int64_t g) {
    group_dots<V>(q + g * group * d, k, group, d, dot);
    for (int64_t j = 0; j < group; ++j) {
      const float score = dot[j] * scale;
      scores[(g * group + j) * count + p] = softcap > 0 ? std::tanh(score / softcap) * softcap : score;
    }
  });
  for (int64_t h = g0 * group; h < g1 * group; ++h) {
    float* row = scores + h * count;
    top[h] = *std::max_element(row, row + count);
    total[h] = exp_shifted(row, count, top[h]);
  }
  std::fill(acc + g0 * group * dv, acc + g1 * group * dv, 0.f);
  each_position(c.values, c.vb, c.vt, c.vh, dv, g0, g1, c, i, lo, hi, [&](int64_t p, const T* v, int64_t g) {
    for (int64_t j = g * group; j < (g + 1) * group; ++j) {
      const float w = scores[j * count + p];
      float* a = acc + j * dv;
      for (int64_t e = 0; e < dv; ++e) a[e] += w * static_cast<float>(v[e]);
    }
  });
}

template <class V>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& table,
            const at::Tensor& starts, const at::Tensor& ends, double scale, double softcap, at::Tensor& out) {
  using T = typename V::T;
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = keys.size(2), dv = values.size(3), group = heads / kv_heads;
  const Cache<T> c{keys.data_ptr<T>(), values.data_ptr<T>(), table.data_ptr<int64_t>(), keys.size(1), table.size(1),
                   keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2)};
  const T* qs = q.data_ptr<T>();
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* last = ends.data_ptr<int64_t>();
  T* os = out.data_ptr<T>();
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);

  // the pieces, sequence by sequence; a sequence of several pieces keeps each one's partial softmax in
  // `partial` ([heads, dv + 2] floats: acc, then top and total) until they are merged. With fewer pieces than
  // threads (a short batch of one), each piece's key heads are shared out too: heads are independent, so
  // this changes no sum. The lists and the partial softmaxes lie in room this thread keeps from call to call (a
  // decode step allocates nothing here once its sizes were seen), named by references, which the workers' lambda
  // captures (a thread_local named inside it would be the worker's own).
  struct Piece { int64_t i, lo, hi, g0, g1, slot; };
  thread_local std::vector<Piece> pieces_room;
  thread_local std::vector<int64_t> done_room;
  thread_local std::vector<float> partial_room, sum_room;
  std::vector<Piece>& pieces = pieces_room;
  std::vector<int64_t>& done = done_room;  // work (keys x key heads) in the pieces before each one
  std::vector<float>& partial = partial_room;
  std::vector<float>& sum = sum_room;
  pieces.clear();
  done.assign(1, 0);
  int64_t cuts = 0;
  for (int64_t i = 0; i < n; ++i) cuts += (last[i] - first[i] + kPiece - 1) / kPiece;
  const int64_t threads = at::get_num_threads();
  const int64_t split = std::min(kv_heads, std::max<int64_t>(1, (threads + cuts - 1) / std::max<int64_t>(cuts, 1)));
  int64_t slots = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t cut = (last[i] - first[i] + kPiece - 1) / kPiece;
    for (int64_t k = 0; k < cut; ++k) {
      const int64_t lo = first[i] + k * kPiece, hi = std::min(lo + kPiece, last[i]);
      for (int64_t h = 0; h < split; ++h) {
        const int64_t g0 = kv_heads * h / split, g1 = kv_heads * (h + 1) / split;
        pieces.push_back({i, lo, hi, g0, g1, cut > 1 ? slots++ : -1});
        done.push_back(done.back() + (hi - lo) * (g1 - g0));
      }
    }
  }
  const int64_t stride = heads * (dv + 2);
  if ((int64_t)partial.size() < slots * stride) partial.resize(slots * stride);
  const Shares shares(done, threads);
  at::parallel_for(0, shares.parts(), 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> scores, own;  // each thread's own room
    if ((int64_t)scores.size() < heads * kPiece) scores.resize(heads * kPiece);
    if ((int64_t)own.size() < stride) own.resize(stride);
    for (int64_t part = p0; part < p1; ++part)
      for (int64_t k = shares.first(part), stop = shares.first(part + 1); k < stop; ++k) {
        const Piece& pc = pieces[k];
        float* to = pc.slot >= 0 ? partial.data() + pc.slot * stride : own.data();
        piece<V>(c, qs + pc.i * heads * d, pc.i, pc.lo, pc.hi, pc.g0, pc.g1, group, d, dv, s, cap, scores.data(),
                 to + heads * dv, to + heads * dv + heads, to);
        if (pc.slot >= 0) continue;
        for (int64_t h = pc.g0 * group; h < pc.g1 * group; ++h) {
          T* o = os + (pc.i * heads + h) * dv;
          const float inverse = 1.f / to[heads * dv + heads + h];
          for (int64_t e = 0; e < dv; ++e) o[e] = T(to[h * dv + e] * inverse);
        }
      }
  });
  // sequences of several pieces: their partial softmaxes merged in piece order, head by head
  if ((int64_t)sum.size() < dv) sum.resize(dv);
  for (size_t k = 0; k < pieces.size();) {
    size_t e = k + 1;
    while (e < pieces.size() && pieces[e].i == pieces[k].i) ++e;
    for (int64_t h = 0; pieces[k].slot >= 0 && h < heads; ++h) {
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      auto holds = [&](size_t m) { return pieces[m].g0 * group <= h && h < pieces[m].g1 * group; };
      for (size_t m = k; m < e; ++m)
        if (holds(m)) top = std::max(top, partial[pieces[m].slot * stride + heads * dv + h]);
      std::fill(sum.begin(), sum.begin() + dv, 0.f);
      for (size_t m = k; m < e; ++m) {
        if (!holds(m)) continue;
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
// paged cache; table [n, width] each sequence's blocks; the sequence attends positions [starts[i], ends[i]);
// softcap: 0, or the cap of each score (Gemma 2's attention logits); into `out` [n, heads, dv] where defined
at::Tensor paged_decode_into(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& table, const at::Tensor& starts, const at::Tensor& ends, double scale,
                             double softcap, const at::Tensor& into) {
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
  at::Tensor out = into.defined() ? into : at::empty({n, heads, values.size(3)}, q.options());
  TORCH_CHECK(out.sizes() == at::IntArrayRef({n, heads, values.size(3)}) && out.scalar_type() == q.scalar_type() &&
                  out.is_contiguous(), "paged_decode: out is not a contiguous [n, heads, dv] of q's dtype");
#if STER_KERNELS_ISA
  const at::Tensor qc = q.contiguous();
  if (q.scalar_type() == at::kFloat)
    attend<F32Lanes>(qc, keys, values, tab, first, last, scale, softcap, out);
  else
    attend<Bf16Lanes>(qc, keys, values, tab, first, last, scale, softcap, out);
#endif
  return out;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& table,
                        const at::Tensor& starts, const at::Tensor& ends, double scale, double softcap) {
  return paged_decode_into(q, keys, values, table, starts, ends, scale, softcap, at::Tensor());
}

// ---- a decode step's attention without a way back into Python per layer ------------------------------------
//
// A compiled step calls attention once a layer through an operator whose body is Python (model/compiled.py's
// ster_dist::attend): about 50 us a layer of boxing, interpreter and checks around this kernel's 10, 1.5 ms of
// a 30-layer one-token step. Where a step is decodes only (one query a row, every key visible), the step
// states once, before its graph runs, where each layer's keys lie and where its new key goes (a "plan", kept
// per thread, as steps nest); `attend_planned` then stores the key and value and runs the kernel itself,
// and hands any layer the plan does not cover to ster_dist::attend.
//
// A layer with a sliding window (Mistral, Phi-3, Gemma's local layers) or chunked attention (Llama 4) reads a
// range of its keys: a row whose new token sits at position p = ends - 1 sees keys p - key < window and, with
// chunks, only those of p's own chunk (model/paged_step.py's key_range, model/step.py's mask).
struct Plan {
  std::vector<at::Tensor> keys, values;  // per layer: [blocks, block_size, kv_heads, width], as paged_decode reads
  std::vector<double> scales;            // per layer: > 0 where planned
  std::vector<int64_t> windows, chunks;  // per layer: 0 where every earlier key is seen (empty: every layer)
  std::vector<double> softcaps;          // per layer: 0 where scores are not capped (empty: none is)
  at::Tensor write_blocks, write_slots;  // per row: where its new key and value go
  at::Tensor table, starts, ends;        // per row: as paged_decode takes them
  bool packed;                           // rows along dim 2 of [1, heads, rows, d] (a paged step), else dim 0
  std::map<std::pair<int64_t, int64_t>, at::Tensor> firsts;  // per (window, chunk): each row's first key

  // each row's first key in a layer with this window and chunk (0: none), made once a step
  const at::Tensor& first_keys(int64_t window, int64_t chunk) {
    if (window <= 0 && chunk <= 0) return starts;
    auto [at, fresh] = firsts.try_emplace({window, chunk});
    if (fresh) {
      at->second = starts.clone();
      int64_t* first = at->second.data_ptr<int64_t>();
      const int64_t* end = ends.data_ptr<int64_t>();
      for (int64_t r = 0; r < at->second.numel(); ++r) {
        if (window > 0) first[r] = std::max(first[r], end[r] - window);
        if (chunk > 0) first[r] = std::max(first[r], (end[r] - 1) / chunk * chunk);
      }
    }
    return at->second;
  }
};
thread_local std::vector<Plan> plans;

void push_plan(at::TensorList keys, at::TensorList values, at::ArrayRef<double> scales, const at::Tensor& write_blocks,
               const at::Tensor& write_slots, const at::Tensor& table, const at::Tensor& starts,
               const at::Tensor& ends, bool packed, at::IntArrayRef windows, at::IntArrayRef chunks,
               at::ArrayRef<double> softcaps) {
  TORCH_CHECK(keys.size() == scales.size() && values.size() == scales.size(), "push_plan: one key, value and scale a layer");
  TORCH_CHECK((windows.empty() || windows.size() == scales.size()) &&
                  (chunks.empty() || chunks.size() == scales.size()) &&
                  (softcaps.empty() || softcaps.size() == scales.size()),
              "push_plan: one window, one chunk and one soft cap a layer, or none");
  TORCH_CHECK(starts.scalar_type() == at::kLong && ends.scalar_type() == at::kLong && starts.numel() == table.size(0) &&
                  ends.numel() == table.size(0), "push_plan: int64 starts and ends, one a row");
  const int64_t n = table.size(0);
  TORCH_CHECK(write_blocks.scalar_type() == at::kLong && write_slots.scalar_type() == at::kLong &&
                  write_blocks.numel() == n && write_slots.numel() == n, "push_plan: int64 write blocks and slots, one a row");
  Plan plan{keys.vec(), values.vec(), scales.vec(), windows.vec(), chunks.vec(), softcaps.vec(),
            write_blocks.contiguous(), write_slots.contiguous(), table.contiguous(), starts.contiguous(), ends.contiguous(), packed, {}};
  const int64_t* b = plan.write_blocks.data_ptr<int64_t>();
  const int64_t* s = plan.write_slots.data_ptr<int64_t>();
  for (size_t layer = 0; layer < scales.size(); ++layer) {
    if (scales[layer] <= 0) continue;
    const at::Tensor& k = keys[layer];
    const at::Tensor& v = values[layer];
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == v.size(0) && k.size(1) == v.size(1) &&
                    k.stride(3) == 1 && v.stride(3) == 1, "push_plan: layer ", layer, "'s keys and values are not a cache");
    for (int64_t r = 0; r < n; ++r)
      TORCH_CHECK(0 <= b[r] && b[r] < k.size(0) && 0 <= s[r] && s[r] < k.size(1), "push_plan: row ", r,
                  " writes outside layer ", layer, "'s cache");
  }
  plans.push_back(std::move(plan));
}

void pop_plan() {
  TORCH_CHECK(!plans.empty(), "pop_plan: no plan");
  plans.pop_back();
}

// the rows of x ([batch, heads, 1, d], or packed [1, heads, rows, d]) as [rows, heads, d]
at::Tensor by_row(const at::Tensor& x, bool packed) { return packed ? x.select(0, 0).transpose(0, 1) : x.select(2, 0); }

template <class T>
void store(const at::Tensor& rows, const at::Tensor& cache, const int64_t* blocks, const int64_t* slots) {
  const int64_t n = rows.size(0), heads = rows.size(1), d = rows.size(2);
  const T* src = rows.data_ptr<T>();
  T* dst = cache.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < heads; ++h)
      std::copy_n(src + r * rows.stride(0) + h * rows.stride(1), d,
                  dst + blocks[r] * cache.stride(0) + slots[r] * cache.stride(1) + h * cache.stride(2));
}

at::Tensor attend_planned(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& layer) {
  const Plan* plan = plans.empty() ? nullptr : &plans.back();
  const bool packed = plan != nullptr && plan->packed;
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend_planned: q, k and v of 4 dimensions");
  const at::Tensor out = ster_kernels::planned_rows(layer.item<int64_t>(), by_row(q, packed), by_row(k, packed),
                                                    by_row(v, packed));  // [rows, heads, dv]
  if (!out.defined()) {
    static auto python = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ster_dist::attend", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    return python.call(q, k, v, layer);
  }
  // in the layout of q with the values' width, contiguous: what the graph was traced to read
  return packed ? out.transpose(0, 1).unsqueeze(0).contiguous() : out.unsqueeze(2);
}

}  // namespace

at::Tensor ster_kernels::planned_rows(int64_t index, const at::Tensor& q, const at::Tensor& kr, const at::Tensor& vr,
                                      const at::Tensor& out) {
  Plan* plan = plans.empty() ? nullptr : &plans.back();
  if (plan == nullptr || index < 0 || index >= (int64_t)plan->scales.size() || plan->scales[index] <= 0)
    return at::Tensor();
  const at::Tensor& keys = plan->keys[index];
  const at::Tensor& values = plan->values[index];
  const int64_t n = plan->table.size(0);
  TORCH_CHECK(q.dim() == 3 && kr.dim() == 3 && vr.dim() == 3 && kr.size(0) == n && vr.size(0) == n &&
                  kr.size(1) == keys.size(2) && kr.size(2) == keys.size(3) && vr.size(1) == values.size(2) &&
                  vr.size(2) == values.size(3) && kr.stride(2) == 1 && vr.stride(2) == 1,
              "attend_planned: this step's keys and values do not fit layer ", index, "'s plan");
  TORCH_CHECK(kr.scalar_type() == keys.scalar_type() && vr.scalar_type() == values.scalar_type(),
              "attend_planned: keys and values of another dtype than the cache");
  const int64_t* blocks = plan->write_blocks.data_ptr<int64_t>();
  const int64_t* slots = plan->write_slots.data_ptr<int64_t>();
  if (kr.scalar_type() == at::kFloat) {
    store<float>(kr, keys, blocks, slots);
    store<float>(vr, values, blocks, slots);
  } else {
    TORCH_CHECK(kr.scalar_type() == at::kBFloat16, "attend_planned: f32 or bf16");
    store<c10::BFloat16>(kr, keys, blocks, slots);
    store<c10::BFloat16>(vr, values, blocks, slots);
  }
  const at::Tensor& first = plan->first_keys(plan->windows.empty() ? 0 : plan->windows[index],
                                             plan->chunks.empty() ? 0 : plan->chunks[index]);
  return paged_decode_into(q, keys, values, plan->table, first, plan->ends, plan->scales[index],
                           plan->softcaps.empty() ? 0.0 : plan->softcaps[index], out);
}

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("paged_decode(Tensor q, Tensor keys, Tensor values, Tensor table, Tensor starts, Tensor ends, float scale, "
        "float softcap=0.0) -> Tensor");
  m.def("push_plan(Tensor[] keys, Tensor[] values, float[] scales, Tensor write_blocks, Tensor write_slots, "
        "Tensor table, Tensor starts, Tensor ends, bool packed, int[] windows=[], int[] chunks=[], "
        "float[] softcaps=[]) -> ()", &push_plan);
  m.def("pop_plan() -> ()", &pop_plan);
  m.def("attend_planned(Tensor q, Tensor k, Tensor v, Tensor layer) -> Tensor");
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("attend_planned", &attend_planned);
}
