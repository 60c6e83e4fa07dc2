// A decode step through a stack of plain Llama-, Gemma- or OLMo-2-shaped layers in one call (model/native_stack.py):
// each layer's norm, fused q/k/v product, head norms and rotation, attention over its cache (within its window,
// under its soft cap), output product, norm after it, residual sum, second norm, fused gate/up product, SiLU or GELU
// gate, down product and norm after it, without returning to Python between them.
//
// Why: in a compiled one-token step of SmolLM2 (f32, 2 threads) the products read at copy bandwidth, yet a
// quarter of the main thread's time went to the graph's Python wrapper, torch's dispatcher and allocations
// between them (per layer four generated loops, four product calls, attention, a dozen views: bench/README.md);
// llama.cpp runs the same chain with no interpreter.
//
// The products and the attention are the very functions the compiled graph calls (entries.h), and the
// elementwise work is written as inductor writes it for these layers (at::vec's vectors of this CPU's width, the
// same order of operations, no fused multiply-adds: inductor compiles with -ffp-contract=off), so a row's result
// is the same bits as through the graph: a request reads the same logits whether its step ran here, or through the
// graph beside a prompt's chunk (tests/test_native_stack.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

// at::vec's vectors for the width inductor picks on this CPU (torch._inductor.cpu_vec_isa: AVX-512 where the CPU
// has it, else AVX2), as its generated code is built
#if defined(__AVX512F__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "entries.h"

namespace {

constexpr int64_t kParallelRows = 16;  // fewer rows: elementwise work on the calling thread (a fork costs more)

// How inductor's loops read and write a dtype: f32 a vector of floats at a time; bf16 as many as one vector of
// bf16 holds (twice a float vector's), widened to a pair of float vectors, computed in f32 and rounded only where
// a loop stores (its intermediate casts elided), so these helpers round where its loops do and nowhere else.
template <class T>
struct Lanes;

template <>
struct Lanes<float> {
  using V = at::vec::VectorizedN<float, 1>;
  static constexpr int64_t kStep = at::vec::Vectorized<float>::size();
  static V load(const float* p, int64_t n) { return V::loadu(p, n); }
  static void store(const V& v, float* p, int64_t n) { v.store(p, n); }
};

template <>
struct Lanes<c10::BFloat16> {
  using V = at::vec::VectorizedN<float, 2>;
  static constexpr int64_t kStep = at::vec::Vectorized<c10::BFloat16>::size();
  static V load(const c10::BFloat16* p, int64_t n) {
    return at::vec::convert<float, 2, c10::BFloat16, 1>(at::vec::Vectorized<c10::BFloat16>::loadu(p, n));
  }
  static void store(const V& v, c10::BFloat16* p, int64_t n) {
    at::vec::convert<c10::BFloat16, 1, float, 2>(v).store(p, n);
  }
  // a value the graph keeps in f32 between two of its operations (a normed head, rotated in the same loop)
  static V load(const float* p, int64_t n) { return V::loadu(p, n); }
  static void store(const V& v, float* p, int64_t n) { v.store(p, n); }
};

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// (a + b)'s sum of squares (b may be null), lane by lane and then across the lanes, as inductor sums a row
template <class T, class B>
float square_sum(const T* a, const B* b, int64_t width) {
  using L = Lanes<T>;
  using V = typename L::V;
  V acc(0);
  const int64_t whole = width / L::kStep * L::kStep;
  for (int64_t i = 0; i < whole; i += L::kStep) {
    V x = L::load(a + i, L::kStep);
    if (b) x = x + L::load(b + i, L::kStep);
    acc = acc + x * x;
  }
  if (whole < width) {  // inductor's masked tail: lanes past the row keep their sums
    const int64_t tail = width - whole;
    V x = L::load(a + whole, tail);
    if (b) x = x + L::load(b + whole, tail);
    acc = V::set(acc, acc + x * x, tail);
  }
  float sum = 0;
  sum = sum + at::vec::vec_reduce_all<float, V::size() / at::vec::Vectorized<float>::size()>(
                  [](at::vec::Vectorized<float>& x, at::vec::Vectorized<float>& y) { return x + y; }, acc);
  return sum;
}

// out = (a + b) * rsqrt(sum / width + eps) * (w + offset) for one row, `sum` being (a + b)'s sum of squares (Norm's
// RMS over a scale in the model's dtype; Gemma's scales are stored as offsets from one)
template <class T, class B, class O>
void norm_row(const T* a, const B* b, float sum, const T* w, float offset, float eps, int64_t width, O* out) {
  using L = Lanes<T>;
  using V = typename L::V;
  const float mean = sum / static_cast<float>(width);
  const V scale(1 / std::sqrt(float(mean + eps)));
  for (int64_t i = 0; i < width; i += L::kStep) {
    const int64_t n = std::min(L::kStep, width - i);
    V x = L::load(a + i, n);
    if (b) x = x + L::load(b + i, n);
    const V weight = offset != 0.0f ? L::load(w + i, n) + V(offset) : L::load(w + i, n);
    L::store(x * scale * weight, out + i, n);
  }
}

template <class T, class B, class O>
void rms_row(const T* a, const B* b, const T* w, float offset, float eps, int64_t width, O* out) {
  norm_row(a, b, square_sum(a, b, width), w, offset, eps, width, out);
}

// x's first `half` channel pairs rotated by one row's cos and sin (rotate-half or interleaved pairs), the rest as
// they are: Llama's apply_rotary for one head
template <class T, class X>
void rotate_head(const X* x, const T* cos, const T* sin, int64_t half, int64_t d, bool interleaved, T* out) {
  using L = Lanes<T>;
  using V = typename L::V;
  if (interleaved) {  // elementwise in f32, rounded once
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = float(x[2 * i]), x2 = float(x[2 * i + 1]), c = float(cos[i]), s = float(sin[i]);
      const float first = x1 * c - x2 * s, second = x2 * c + x1 * s;
      out[2 * i] = T(first);
      out[2 * i + 1] = T(second);
    }
  } else {
    for (int64_t i = 0; i < half; i += L::kStep) {
      const int64_t n = std::min(L::kStep, half - i);
      const V x1 = L::load(x + i, n), x2 = L::load(x + half + i, n);
      const V c = L::load(cos + i, n), s = L::load(sin + i, n);
      L::store(x1 * c - x2 * s, out + i, n);
      L::store(x2 * c + x1 * s, out + half + i, n);
    }
  }
  for (int64_t i = 2 * half; i < d; ++i) out[i] = T(x[i]);
}

// act(gate) * up for one row, gate and up side by side in `gate_up`: SiLU, or GELU by its tanh approximation
// (Gemma's), each as inductor expands it
template <class T>
void gate_row(const T* gate_up, int64_t inner, bool gelu, T* out) {
  using L = Lanes<T>;
  using V = typename L::V;
  const T* up = gate_up + inner;
  for (int64_t i = 0; i < inner; i += L::kStep) {
    const int64_t n = std::min(L::kStep, inner - i);
    const V g = L::load(gate_up + i, n);
    V act;
    if (gelu) {
      const V inside = (g + g * g * g * V(static_cast<float>(0.044715))) * V(static_cast<float>(0.7978845608028654));
      act = g * V(static_cast<float>(0.5)) * (inside.tanh() + V(1.0f));
    } else {
      act = g / (g.neg().exp() + V(1.0f));
    }
    L::store(act * L::load(up + i, n), out + i, n);
  }
}

// out = (y + bias) * multiplier for one row, kept in f32 (bias may be null): a sublayer's output as it joins the
// residual (RowLinear adds its bias after the product; Granite scales each sublayer's output)
template <class T>
void joining_row(const T* y, const T* bias, float multiplier, int64_t width, float* out) {
  using L = Lanes<T>;
  using V = typename L::V;
  for (int64_t i = 0; i < width; i += L::kStep) {
    const int64_t n = std::min(L::kStep, width - i);
    V v = L::load(y + i, n);
    if (bias) v = v + L::load(bias + i, n);
    if (multiplier != 1.0f) v = v * V(multiplier);
    L::store(v, out + i, n);
  }
}

// h = (h + a) + m for one row (m may be null), rounded once: the layer's residual sum as the graph's last loop
// makes it; where `sum` is given, also h's sum of squares before that rounding
template <class T>
void residual_row(T* h, float* a, const float* m, int64_t width, float* sum = nullptr) {
  using L = Lanes<T>;
  for (int64_t i = 0; i < width; i += L::kStep) {
    const int64_t n = std::min(L::kStep, width - i);
    auto v = L::load(h + i, n) + L::load(a + i, n);
    if (m) v = v + L::load(m + i, n);
    if (sum) L::store(v, a + i, n);  // kept unrounded for its squares
    L::store(v, h + i, n);
  }
  if (sum) *sum = square_sum(a, static_cast<const float*>(nullptr), width);
}

#pragma GCC pop_options

template <class Fn>
void each_row(int64_t rows, Fn fn) {
  at::parallel_for(0, rows, kParallelRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r);
  });
}

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// attn norm, qkv weight and bias, o weight and bias, mlp norm, gate_up and its bias, down and its bias, the query
// and key heads' norms, the norms after attention and after the feed-forward (an empty tensor where a layer has no
// such bias or norm)
constexpr int64_t kPerLayer = 14;
// eps and offset of attention's norm, of the feed-forward's, of the heads'; the multiplier of each sublayer's output;
// eps of the norms after the sublayers, and the offsets of each
constexpr int64_t kNumbers = 10;

// room for n values of U on the calling thread, kept from step to step (no allocation per row and layer)
template <class U>
U* scratch(int64_t n) {
  thread_local std::vector<U> room;
  if ((int64_t)room.size() < n) room.resize(n);
  return room.data();
}

// each of a row's heads (`count` of `d` channels from `x`) normed where `norm` is given (Qwen3's and Gemma 3's
// per-head query and key norms, or with `whole` OLMo 2's over all of them at once), then rotated where `cos` is given
// (not in SmolLM3's unrotated layers), into out (`round`: the normed heads rounded to T before their rotation, else
// kept in f32)
template <class T>
void heads_of_row(const T* x, int64_t count, int64_t d, const T* norm, bool whole, float offset, float eps,
                  const T* cos, const T* sin, int64_t half, bool interleaved, bool round, T* out) {
  if (norm && whole) {
    if (!cos) return rms_row(x, static_cast<const float*>(nullptr), norm, offset, eps, count * d, out);
    auto rotated = [&](auto* normed) {
      rms_row(x, static_cast<const float*>(nullptr), norm, offset, eps, count * d, normed);
      for (int64_t j = 0; j < count; ++j) rotate_head(normed + j * d, cos, sin, half, d, interleaved, out + j * d);
    };
    if (round) rotated(scratch<T>(count * d));
    else rotated(scratch<float>(count * d));
    return;
  }
  float* normed = norm && cos && !round ? scratch<float>(d) : nullptr;
  T* rounded = norm && cos && round ? scratch<T>(d) : nullptr;
  for (int64_t j = 0; j < count; ++j) {
    if (norm && cos && round) {
      rms_row(x + j * d, static_cast<const float*>(nullptr), norm, offset, eps, d, rounded);
      rotate_head(rounded, cos, sin, half, d, interleaved, out + j * d);
    } else if (norm && cos) {
      rms_row(x + j * d, static_cast<const float*>(nullptr), norm, offset, eps, d, normed);
      rotate_head(normed, cos, sin, half, d, interleaved, out + j * d);
    } else if (norm) {
      rms_row(x + j * d, static_cast<const float*>(nullptr), norm, offset, eps, d, out + j * d);
    } else if (cos) {
      rotate_head(x + j * d, cos, sin, half, d, interleaved, out + j * d);
    } else {
      std::copy_n(x + j * d, d, out + j * d);
    }
  }
}

// A step's tensors (the normed rows, the products' outputs, the heads, attention's output), kept from step to step
// by the thread that runs them: each slot's storage grows to the largest size asked of it and is viewed at this
// step's, so a step of a batch size seen before allocates nothing but its output (issue 18's fifth item).
class Room {
 public:
  enum Slot { kX, kQ, kK, kJoined, kQkv, kAttended, kO, kGateUp, kAct, kM, kSlots };

  at::Tensor take(Slot slot, at::IntArrayRef sizes, at::ScalarType dtype) {
    Kept& kept = kept_[slot];
    if (kept.view.defined() && kept.view.scalar_type() == dtype && kept.view.sizes() == sizes) return kept.view;
    const int64_t n = c10::multiply_integers(sizes);
    if (!kept.storage.defined() || kept.storage.scalar_type() != dtype || kept.storage.numel() < n)
      kept.storage = at::empty({n}, at::TensorOptions().dtype(dtype));
    kept.view = kept.storage.narrow(0, 0, n).view(sizes);
    return kept.view;
  }

 private:
  struct Kept {
    at::Tensor storage, view;
  };
  Kept kept_[kSlots];
};

template <class T>
const T* data_or_null(const at::Tensor& t) {
  return t.numel() ? t.data_ptr<T>() : nullptr;
}

template <class T>
void layers_of(at::Tensor& h, at::TensorList weights, at::IntArrayRef layers, at::ArrayRef<double> numbers,
               at::IntArrayRef shape, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
               at::IntArrayRef rotations) {
  const int64_t rows = h.size(0), hidden = h.size(1);
  const int64_t heads = shape[0], kv = shape[1], d = shape[2], dv = shape[3];
  const bool gelu = shape[4] != 0;  // the gate's activation: GELU by tanh, else SiLU
  // Where inductor's loops store in bf16 depends on the graph: the one-token graph (static, one row) keeps a layer's
  // sums in f32 until its last; the graph of several rows stores (rounds) a head normed over offsets (Gemma 3's)
  // before rotating it, and the residual after attention where norms follow the sublayers. So do these loops.
  const bool apart = rows > 1;
  const int64_t q_width = heads * d, k_width = kv * d;
  const at::ScalarType dtype = h.scalar_type();
  thread_local Room room;
  const at::Tensor x = room.take(Room::kX, {rows, hidden}, dtype);
  const at::Tensor q = room.take(Room::kQ, {rows, heads, d}, dtype), k = room.take(Room::kK, {rows, kv, d}, dtype);
  // each sublayer's output as it joins the residual, in f32 (the graph keeps it in registers)
  const at::Tensor joined = room.take(Room::kJoined, {2, rows, hidden}, at::kFloat);
  T* hs = h.data_ptr<T>();
  T* xs = x.data_ptr<T>();
  float* attn_out = joined[0].data_ptr<float>();
  float* mlp_out = joined[1].data_ptr<float>();
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor* w = weights.data() + kPerLayer * l;
    const double* n = numbers.data() + kNumbers * l;
    const float eps_attn = n[0], off_attn = n[1], eps_mlp = n[2], off_mlp = n[3], eps_heads = n[4];
    const float off_heads = n[5], multiplier = n[6], eps_post = n[7], off_post_attn = n[8], off_post_mlp = n[9];
    // norms after the sublayers (Gemma 3's and GLM-4's sandwich): each sublayer's output normed before it joins
    // the residual
    const bool post = w[12].numel() != 0;
    // norms before the sublayers (Llama's), or none (OLMo 2 norms each sublayer's output only): then each
    // sublayer reads h itself, and h is stored (rounded) after attention, as the feed-forward's product reads it
    const bool pre = w[0].numel() != 0;
    // query and key norms over each whole projection (OLMo 2's), not head by head (one head: the same sums)
    const bool whole = w[10].numel() != 0 && w[10].numel() != d;
    const int64_t table = rotations[2 * l];  // the layer's rotary tables, or none (-1)
    const bool interleaved = rotations[2 * l + 1] != 0;
    const int64_t half = table >= 0 ? cos[table].size(1) : 0;
    const T* cos_rows = table >= 0 ? cos[table].data_ptr<T>() : nullptr;
    const T* sin_rows = table >= 0 ? sin[table].data_ptr<T>() : nullptr;
    if (pre)
      each_row(rows, [&](int64_t r) {
        rms_row(hs + r * hidden, static_cast<const float*>(nullptr), w[0].data_ptr<T>(), off_attn, eps_attn, hidden,
                xs + r * hidden);
      });
    TORCH_CHECK(w[1].dim() == 2 && w[1].size(0) == q_width + k_width + kv * dv, "stack_step: layer ", layers[l],
                "'s fused projection is not q, k and v of the shape given");
    const at::Tensor qkv = ster_kernels::packed_product(pre ? x : h, w[1], maybe(w[2]),
                                                        room.take(Room::kQkv, {rows, w[1].size(0)}, dtype));
    const T* all = qkv.data_ptr<T>();
    const int64_t stride = qkv.size(1);
    const bool round_heads = apart && off_heads != 0.0f;
    each_row(rows, [&](int64_t r) {
      const T* c = cos_rows ? cos_rows + r * half : nullptr;
      const T* s = sin_rows ? sin_rows + r * half : nullptr;
      heads_of_row(all + r * stride, heads, d, data_or_null<T>(w[10]), whole, off_heads, eps_heads, c, s, half,
                   interleaved, round_heads, q.data_ptr<T>() + r * heads * d);
      heads_of_row(all + r * stride + q_width, kv, d, data_or_null<T>(w[11]), whole, off_heads, eps_heads, c, s, half,
                   interleaved, round_heads, k.data_ptr<T>() + r * kv * d);
    });
    const at::Tensor v = qkv.narrow(1, q_width + k_width, kv * dv).view({rows, kv, dv});
    const at::Tensor attended =
        ster_kernels::planned_rows(layers[l], q, k, v, room.take(Room::kAttended, {rows, heads, dv}, dtype));
    TORCH_CHECK(attended.defined(), "stack_step: layer ", layers[l], " is not in the decode plan");
    TORCH_CHECK(w[3].dim() == 2 && w[3].size(0) == hidden, "stack_step: layer ", layers[l],
                "'s output projection does not give the hidden width");
    const at::Tensor o = ster_kernels::packed_product(attended.view({rows, heads * dv}), w[3], std::nullopt,
                                                      room.take(Room::kO, {rows, hidden}, dtype));
    const T* os = o.data_ptr<T>();
    each_row(rows, [&](int64_t r) {  // what joins the residual: o, biased and scaled, or normed
      if (post)
        rms_row(os + r * hidden, static_cast<const float*>(nullptr), w[12].data_ptr<T>(), off_post_attn, eps_post,
                hidden, attn_out + r * hidden);
      else
        joining_row(os + r * hidden, data_or_null<T>(w[4]), multiplier, hidden, attn_out + r * hidden);
      if (!pre) {  // h + that, rounded: what the feed-forward reads
        residual_row(hs + r * hidden, attn_out + r * hidden, static_cast<const float*>(nullptr), hidden);
      } else if (post && apart) {  // h + that, rounded; the next norm's sum is of the unrounded
        float sum;
        residual_row(hs + r * hidden, attn_out + r * hidden, static_cast<const float*>(nullptr), hidden, &sum);
        norm_row(hs + r * hidden, static_cast<const float*>(nullptr), sum, w[5].data_ptr<T>(), off_mlp, eps_mlp, hidden,
                 xs + r * hidden);
      } else {  // the norm of h + that, which stays unrounded until the layer's last sum
        rms_row(hs + r * hidden, attn_out + r * hidden, w[5].data_ptr<T>(), off_mlp, eps_mlp, hidden, xs + r * hidden);
      }
    });
    TORCH_CHECK(w[6].dim() == 2 && w[6].size(0) % 2 == 0 && w[8].dim() == 2 && w[8].size(0) == hidden,
                "stack_step: layer ", layers[l], "'s feed-forward is not gate and up side by side, then down to the "
                "hidden width");
    const int64_t inner = w[6].size(0) / 2;
    const at::Tensor gate_up = ster_kernels::packed_product(pre ? x : h, w[6], maybe(w[7]),
                                                            room.take(Room::kGateUp, {rows, 2 * inner}, dtype));
    const at::Tensor act = room.take(Room::kAct, {rows, inner}, dtype);
    each_row(rows, [&](int64_t r) {
      gate_row(gate_up.data_ptr<T>() + r * 2 * inner, inner, gelu, act.data_ptr<T>() + r * inner);
    });
    const at::Tensor m =
        ster_kernels::packed_product(act, w[8], std::nullopt, room.take(Room::kM, {rows, hidden}, dtype));
    const T* ms = m.data_ptr<T>();
    each_row(rows, [&](int64_t r) {
      if (post)
        rms_row(ms + r * hidden, static_cast<const float*>(nullptr), w[13].data_ptr<T>(), off_post_mlp, eps_post,
                hidden, mlp_out + r * hidden);
      else
        joining_row(ms + r * hidden, data_or_null<T>(w[9]), multiplier, hidden, mlp_out + r * hidden);
      if ((post && apart) || !pre)  // h was rounded after attention
        residual_row(hs + r * hidden, mlp_out + r * hidden, static_cast<const float*>(nullptr), hidden);
      else
        residual_row(hs + r * hidden, attn_out + r * hidden, mlp_out + r * hidden, hidden);
    });
  }
}

// h [rows, hidden], one decoding token a row (f32 or bf16); weights kPerLayer a layer and numbers kNumbers, of the
// layers `layers` (their indices in the decode plan in force); shape: heads, kv heads, head width, value width,
// the gate's activation (0 SiLU, 1 GELU by tanh);
// cos and sin: rotary tables [rows, rotated pairs]; rotations: per layer, the index of its tables (-1: not
// rotated) and whether it rotates interleaved pairs (else halves)
at::Tensor stack_step(const at::Tensor& h_in, at::TensorList weights, at::IntArrayRef layers,
                      at::ArrayRef<double> numbers, at::IntArrayRef shape, at::TensorList cos_in,
                      at::TensorList sin_in, at::IntArrayRef rotations) {
  const at::ScalarType dtype = h_in.scalar_type();
  TORCH_CHECK(h_in.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && h_in.device().is_cpu(),
              "stack_step: h as [rows, hidden] f32 or bf16 on the CPU");
  TORCH_CHECK(weights.size() == kPerLayer * layers.size() && numbers.size() == kNumbers * layers.size() &&
                  rotations.size() == 2 * layers.size() && shape.size() == 5, "stack_step: ", kPerLayer,
              " weights, ", kNumbers, " numbers and 2 rotations a layer, and 5 numbers of shape");
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor* w = weights.data() + kPerLayer * l;
    TORCH_CHECK((w[12].numel() == 0) == (w[13].numel() == 0) && (w[0].numel() == 0) == (w[5].numel() == 0),
                "stack_step: layer ", layers[l], " has a norm before (or after) one sublayer and not the other");
    TORCH_CHECK(w[0].numel() != 0 || w[12].numel() != 0, "stack_step: layer ", layers[l], " has no norm at all");
    const int64_t d = shape[2], q_width = shape[0] * d, k_width = shape[1] * d;
    TORCH_CHECK(w[10].numel() == 0 ? w[11].numel() == 0
                                   : (w[10].numel() == d && w[11].numel() == d) ||
                                         (w[10].numel() == q_width && w[11].numel() == k_width),
                "stack_step: layer ", layers[l], "'s query and key norms are not both per head or both over the "
                "whole projections");
  }
  for (const at::Tensor& w : weights)
    TORCH_CHECK(w.numel() == 0 || (w.scalar_type() == dtype && w.is_contiguous()),
                "stack_step: every weight contiguous and of h's dtype");
  TORCH_CHECK(cos_in.size() == sin_in.size(), "stack_step: as many cos tables as sin tables");
  const int64_t rows = h_in.size(0);
  std::vector<at::Tensor> cos, sin;
  for (size_t t = 0; t < cos_in.size(); ++t) {
    cos.push_back(cos_in[t].contiguous().view({rows, -1}));
    sin.push_back(sin_in[t].contiguous().view({rows, -1}));
    TORCH_CHECK(cos[t].scalar_type() == dtype && sin[t].sizes() == cos[t].sizes() && 2 * cos[t].size(1) <= shape[2],
                "stack_step: cos and sin [rows, pairs] of h's dtype, at most half a head");
  }
  for (size_t l = 0; l < layers.size(); ++l)
    TORCH_CHECK(-1 <= rotations[2 * l] && rotations[2 * l] < (int64_t)cos.size(), "stack_step: layer ", layers[l],
                "'s rotary tables are not among those given");
  at::Tensor h = h_in.clone(at::MemoryFormat::Contiguous);  // the step's own: its layers write it in place
  if (dtype == at::kFloat) layers_of<float>(h, weights, layers, numbers, shape, cos, sin, rotations);
  else layers_of<c10::BFloat16>(h, weights, layers, numbers, shape, cos, sin, rotations);
  return h;
}

// floats a vector of this build's loops: where inductor's differ (a CPU whose AVX-512 it does not take, an
// ATEN_CPU_CAPABILITY set), its sums are in another order and steps stay with the graph (model/native_stack.py)
int64_t stack_lanes() { return at::vec::Vectorized<float>::size(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("stack_step(Tensor h, Tensor[] weights, int[] layers, float[] numbers, int[] shape, Tensor[] cos, "
        "Tensor[] sin, int[] rotations) -> Tensor");
  m.def("stack_lanes() -> int", &stack_lanes);
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) { m.impl("stack_step", &stack_step); }
