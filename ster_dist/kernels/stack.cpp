// A decode step through a stack of plain Llama-shaped layers in one call (model/native_stack.py): each layer's
// norm, fused q/k/v product, rotation, attention over its cache, output product, residual sum, second norm,
// fused gate/up product, SiLU gate and down product, without returning to Python between them.
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

#include <cmath>
#include <vector>

#include "entries.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kParallelRows = 16;  // fewer rows: elementwise work on the calling thread (a fork costs more)

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// (a + b)'s sum of squares (b may be null), lane by lane and then across the lanes, as inductor sums a row
float square_sum(const float* a, const float* b, int64_t width) {
  Vec acc(0);
  const int64_t whole = width / kLanes * kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    Vec x = Vec::loadu(a + i);
    if (b) x = x + Vec::loadu(b + i);
    acc = acc + x * x;
  }
  if (whole < width) {  // inductor's masked tail: lanes past the row keep their sums
    const int64_t tail = width - whole;
    Vec x = Vec::loadu(a + whole, tail);
    if (b) x = x + Vec::loadu(b + whole, tail);
    acc = Vec::set(acc, acc + x * x, tail);
  }
  float sum = 0;
  sum = sum + at::vec::vec_reduce_all<float, 1>([](Vec& x, Vec& y) { return x + y; }, acc);
  return sum;
}

// out = (a + b) * rsqrt(mean of its squares + eps) * w for one row (Norm's RMS over a scale in the model's dtype);
// sum: a + b where given (the residual after attention, which the next layer reads)
void rms_row(const float* a, const float* b, const float* w, float eps, int64_t width, float* out, float* sum) {
  const float mean = square_sum(a, b, width) / static_cast<float>(width);
  const Vec scale(1 / std::sqrt(float(mean + eps)));
  for (int64_t i = 0; i < width; i += kLanes) {
    const int64_t n = std::min(kLanes, width - i);
    Vec x = Vec::loadu(a + i, n);
    if (b) {
      x = x + Vec::loadu(b + i, n);
      x.store(sum + i, n);
    }
    (x * scale * Vec::loadu(w + i, n)).store(out + i, n);
  }
}

// x's first `half` channel pairs rotated by one row's cos and sin (rotate-half or interleaved pairs), the rest as
// they are: Llama's apply_rotary for one head
void rotate_head(const float* x, const float* cos, const float* sin, int64_t half, int64_t d, bool interleaved,
                 float* out) {
  if (interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[2 * i], x2 = x[2 * i + 1];
      const float first = x1 * cos[i] - x2 * sin[i], second = x2 * cos[i] + x1 * sin[i];
      out[2 * i] = first;
      out[2 * i + 1] = second;
    }
  } else {
    for (int64_t i = 0; i < half; i += kLanes) {
      const int64_t n = std::min(kLanes, half - i);
      const Vec x1 = Vec::loadu(x + i, n), x2 = Vec::loadu(x + half + i, n);
      const Vec c = Vec::loadu(cos + i, n), s = Vec::loadu(sin + i, n);
      (x1 * c - x2 * s).store(out + i, n);
      (x2 * c + x1 * s).store(out + half + i, n);
    }
  }
  std::copy(x + 2 * half, x + d, out + 2 * half);
}

// silu(gate) * up for one row, gate and up side by side in `gate_up`
void silu_gate_row(const float* gate_up, int64_t inner, float* out) {
  const float* up = gate_up + inner;
  for (int64_t i = 0; i < inner; i += kLanes) {
    const int64_t n = std::min(kLanes, inner - i);
    const Vec g = Vec::loadu(gate_up + i, n);
    ((g / (g.neg().exp() + Vec(1.0f))) * Vec::loadu(up + i, n)).store(out + i, n);
  }
}

void add_rows(const float* a, const float* b, int64_t count, float* out) {
  for (int64_t i = 0; i < count; i += kLanes) {
    const int64_t n = std::min(kLanes, count - i);
    (Vec::loadu(a + i, n) + Vec::loadu(b + i, n)).store(out + i, n);
  }
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
// and key heads' norms (an empty tensor where a layer has no such bias or norm)
constexpr int64_t kPerLayer = 12;

// each of a row's heads (`count` of `d` channels from `x`) normed where `norm` is given (Qwen3's per-head query
// and key norms), then rotated, into out
void heads_of_row(const float* x, int64_t count, int64_t d, const float* norm, float eps, const float* cos,
                  const float* sin, int64_t half, bool interleaved, float* out) {
  std::vector<float> normed(norm ? d : 0);
  for (int64_t j = 0; j < count; ++j) {
    const float* head = x + j * d;
    if (norm) {
      rms_row(head, nullptr, norm, eps, d, normed.data(), nullptr);
      head = normed.data();
    }
    rotate_head(head, cos, sin, half, d, interleaved, out + j * d);
  }
}

// h [rows, hidden], one decoding token a row; weights kPerLayer a layer, of the layers `layers` (their indices in
// the decode plan in force); eps three a layer (attention's norm, the feed-forward's, the heads'); shape: heads,
// kv heads, head width, value width, interleaved; cos and sin [rows, rotated pairs]
at::Tensor stack_step(const at::Tensor& h_in, at::TensorList weights, at::IntArrayRef layers, at::ArrayRef<double> eps,
                      at::IntArrayRef shape, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat && h_in.device().is_cpu(),
              "stack_step: h as [rows, hidden] f32 on the CPU");
  TORCH_CHECK(weights.size() == kPerLayer * layers.size() && eps.size() == 3 * layers.size() && shape.size() == 5,
              "stack_step: ", kPerLayer, " weights and 3 eps a layer, and 5 numbers of shape");
  const int64_t rows = h_in.size(0), hidden = h_in.size(1);
  const int64_t heads = shape[0], kv = shape[1], d = shape[2], dv = shape[3];
  const bool interleaved = shape[4] != 0;
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t half = cos.size(-1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.sizes() == cos.sizes() && cos.numel() == rows * half &&
                  2 * half <= d, "stack_step: cos and sin [rows, pairs] f32, at most half a head's width");
  const int64_t q_width = heads * d, k_width = kv * d;
  at::Tensor h = h_in.contiguous().clone();
  at::Tensor x = at::empty({rows, hidden}, h.options()), mid = at::empty({rows, hidden}, h.options());
  at::Tensor q = at::empty({rows, heads, d}, h.options()), k = at::empty({rows, kv, d}, h.options());
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor* w = weights.data() + kPerLayer * l;
    const float eps_attn = static_cast<float>(eps[3 * l]), eps_mlp = static_cast<float>(eps[3 * l + 1]);
    const float eps_heads = static_cast<float>(eps[3 * l + 2]);
    const float* q_norm = w[10].numel() ? w[10].data_ptr<float>() : nullptr;
    const float* k_norm = w[11].numel() ? w[11].data_ptr<float>() : nullptr;
    each_row(rows, [&](int64_t r) {
      rms_row(h.data_ptr<float>() + r * hidden, nullptr, w[0].data_ptr<float>(), eps_attn, hidden,
              x.data_ptr<float>() + r * hidden, nullptr);
    });
    const at::Tensor qkv = ster_kernels::packed_product(x, w[1], maybe(w[2]));  // [rows, q + k + v]
    TORCH_CHECK(qkv.size(1) == q_width + k_width + kv * dv, "stack_step: layer ", layers[l],
                "'s fused projection is not q, k and v of the shape given");
    const float* all = qkv.data_ptr<float>();
    const int64_t stride = qkv.size(1);
    each_row(rows, [&](int64_t r) {
      const float* c = cos.data_ptr<float>() + r * half;
      const float* s = sin.data_ptr<float>() + r * half;
      heads_of_row(all + r * stride, heads, d, q_norm, eps_heads, c, s, half, interleaved,
                   q.data_ptr<float>() + r * heads * d);
      heads_of_row(all + r * stride + q_width, kv, d, k_norm, eps_heads, c, s, half, interleaved,
                   k.data_ptr<float>() + r * kv * d);
    });
    const at::Tensor v = qkv.narrow(1, q_width + k_width, kv * dv).view({rows, kv, dv});
    const at::Tensor attended = ster_kernels::planned_rows(layers[l], q, k, v);
    TORCH_CHECK(attended.defined(), "stack_step: layer ", layers[l], " is not in the decode plan");
    const at::Tensor o = ster_kernels::packed_product(attended.view({rows, heads * dv}), w[3], maybe(w[4]));
    each_row(rows, [&](int64_t r) {  // mid: the residual after attention; x: its norm
      rms_row(h.data_ptr<float>() + r * hidden, o.data_ptr<float>() + r * hidden, w[5].data_ptr<float>(), eps_mlp,
              hidden, x.data_ptr<float>() + r * hidden, mid.data_ptr<float>() + r * hidden);
    });
    const at::Tensor gate_up = ster_kernels::packed_product(x, w[6], maybe(w[7]));  // [rows, 2 inner]
    const int64_t inner = gate_up.size(1) / 2;
    at::Tensor act = at::empty({rows, inner}, h.options());
    each_row(rows, [&](int64_t r) {
      silu_gate_row(gate_up.data_ptr<float>() + r * 2 * inner, inner, act.data_ptr<float>() + r * inner);
    });
    const at::Tensor m = ster_kernels::packed_product(act, w[8], maybe(w[9]));
    each_row(rows, [&](int64_t r) {
      add_rows(mid.data_ptr<float>() + r * hidden, m.data_ptr<float>() + r * hidden, hidden,
               h.data_ptr<float>() + r * hidden);
    });
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("stack_step(Tensor h, Tensor[] weights, int[] layers, float[] eps, int[] shape, Tensor cos, Tensor sin) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) { m.impl("stack_step", &stack_step); }
