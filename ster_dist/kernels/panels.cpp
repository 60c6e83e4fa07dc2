// y = x W^T (+ b) for any number of rows of x, over a copy of W laid out in panels of output columns (32 with
// AVX-512, 16 with AVX2): the packed weights of a token engine (parallel/packed.py).
//
// Why a layout and a kernel of our own: a panel holds, for each input column k, the weights of its outputs side
// by side ([N/32][K][32] in f32; [N/32][K/2][32][2] in bf16, k's pairs as AVX512_BF16's pairwise product takes
// them; [N/16][K][16] in f32 with AVX2), so the product is one stream of whole-register loads, each multiplied
// by every row of x at once (a broadcast of x's element), with no per-output horizontal sum. On SmolLM2's 30
// layers and head, 2 threads, against oneDNN's own packed layout: f32 1.7-1.9x at 4-8 rows, 1.2x at 16-64,
// equal at 512; bf16 1.6-1.9x at 4-8 rows, 1.3-1.5x at 16-32, equal at 512. At one row it streams the weight as
// fast as the few-row kernel does the plain one. With AVX2 (a Zen 3 CPU, f32): 1.06x the few-row kernel at one
// row and 1.24x at 8, 1.2-1.4x oneDNN's packed product at 12-32 rows, 1.06-1.12x at 256 (bench/README.md).
//
// Each output is one running sum over k in order, whatever the number of rows or threads: a row's product is
// the same bits alone or in any batch, so a request's logits do not depend on who shares its step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "entries.h"
#include "operands.h"

namespace {

using ster_kernels::operands;

#if defined(__AVX512F__)
#define STER_PANELS 1
constexpr int64_t kPanel = 32;  // output columns a panel: two registers of f32 sums
constexpr int kRowBlock = 12;   // rows of x a pass over a panel: 24 sums, 2 weights and a broadcast in 32 registers

struct F32Panel {
  using T = float;
  using W = float;  // the panel's element (with AVX-512 the weight's own)
  static constexpr int64_t kStep = 1;  // input columns one panel row holds
  static __m512 broadcast(const T* x) { return _mm512_set1_ps(*x); }
  static __m512 last(const T* x) { return broadcast(x); }  // never called: a panel row is one column
  static __m512 madd(__m512 acc, __m512 x, const T* w, int half) {
    return _mm512_fmadd_ps(x, _mm512_load_ps(w + 16 * half), acc);
  }
  static void put(T* y, __m512 v, __mmask16 keep) { _mm512_mask_storeu_ps(y, keep, v); }
};

#if defined(__AVX512BF16__)
struct Bf16Panel {
  using T = c10::BFloat16;
  using W = c10::BFloat16;
  static constexpr int64_t kStep = 2;
  static __m512 broadcast(const T* x) {  // x[0] and x[1], in every pair
    int32_t both;
    std::memcpy(&both, x, sizeof(both));
    return _mm512_castsi512_ps(_mm512_set1_epi32(both));
  }
  static __m512 last(const T* x) { return _mm512_castsi512_ps(_mm512_set1_epi32(x->x)); }  // x[0] and a 0 past the row
  static __m512 madd(__m512 acc, __m512 x, const T* w, int half) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(x), (__m512bh)_mm512_load_si512(w + 32 * half));
  }
  static void put(T* y, __m512 v, __mmask16 keep) {
    _mm256_mask_storeu_epi16(y, keep, (__m256i)_mm512_cvtneps_pbh(v));  // round to nearest even, as torch does
  }
};
#endif

// rows [0, R) of x (row stride K) times one panel (columns [0, cols) of it real), into y (row stride N)
template <class P, int R>
inline void pass(const typename P::T* x, int64_t K, const typename P::T* panel, const typename P::T* bias, int64_t cols,
                 typename P::T* y, int64_t N) {
  __m512 sum[R][2];
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
  const int64_t whole = K / P::kStep * P::kStep;
  int64_t k = 0;
  for (; k < whole; k += P::kStep, panel += kPanel * P::kStep) {
    // the panel's two lines sixteen steps ahead, asked for as not to be kept: a decode step streams every weight
    // once, and through the caches it pushed out the step's own working set (the cache, the activations, the
    // interpreter's objects between the calls). bf16 SmolLM2 on an AVX-512 CPU: the products alone as fast,
    // prefill's many-row passes as fast, the eager final norm after the layers 0.17 -> 0.07 ms and a whole
    // batch-1 step 9.3-9.4 -> 6.1-8.9 ms at eight steps ahead; sixteen took a whole step 3-5% less again, in one
    // process with eight (bench/README.md)
    _mm_prefetch(reinterpret_cast<const char*>(panel) + 2048, _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(panel) + 2112, _MM_HINT_NTA);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = P::broadcast(x + r * K + k);
      sum[r][0] = P::madd(sum[r][0], xr, panel, 0);
      sum[r][1] = P::madd(sum[r][1], xr, panel, 1);
    }
  }
  if (k < K)  // an odd K in bf16: the last pair is x's last element and the panel's zero padding
    for (int r = 0; r < R; ++r) {
      const __m512 xr = P::last(x + r * K + k);
      sum[r][0] = P::madd(sum[r][0], xr, panel, 0);
      sum[r][1] = P::madd(sum[r][1], xr, panel, 1);
    }
  const __mmask16 low = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 high = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias) {
    float widened[kPanel] = {};
    for (int64_t c = 0; c < cols; ++c) widened[c] = float(bias[c]);
    b0 = _mm512_loadu_ps(widened);
    b1 = _mm512_loadu_ps(widened + 16);
  }
  for (int r = 0; r < R; ++r) {
    P::put(y + r * N, _mm512_add_ps(sum[r][0], b0), low);
    P::put(y + r * N + 16, _mm512_add_ps(sum[r][1], b1), high);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define STER_PANELS 1
// AVX2: panels of 16 outputs, 6 rows a pass: 12 sums, 2 weights and a broadcast in its 16 registers, as BLAS's
// 6x16 AVX2 kernels hold them. Against the few-row kernel's dot products (each multiply-add loading a register of
// x beside the weight's), a pass loads 8 registers for 12 multiply-adds. bf16 weights are widened to f32 as they
// are read (no bf16 product here), x once a call: the sums are f32 FMAs over exact products either way.
constexpr int64_t kPanel = 16;
constexpr int kRowBlock = 6;

struct F32Panel {
  using T = float;  // x's rows are f32 with AVX2; T is the weight's, the bias's and y's type, W the panel's
  using W = float;
  static constexpr int64_t kStep = 1;
  static void weights(const W* p, __m256& w0, __m256& w1) {
    w0 = _mm256_load_ps(p);
    w1 = _mm256_load_ps(p + 8);
  }
};

// a bf16 panel row holds outputs 0-3, 8-11, 4-7, 12-15 (kBf16Order): interleaved with zeros within each 128-bit
// half, as AVX2's unpacks do, they come out as f32 outputs 0-7 and 8-15, two shuffles for 16 weights
constexpr int64_t kBf16Order[kPanel] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

struct Bf16Panel {
  using T = c10::BFloat16;
  using W = c10::BFloat16;
  static constexpr int64_t kStep = 1;
  static void weights(const W* p, __m256& w0, __m256& w1) {  // a bf16 is the top half of an f32
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
    w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
  }
};

// a bf16 panel widened to f32 in the thread's cache once for many rows (kWidenRows or more): the widening then
// costs nothing per pass
struct Bf16Widened {
  using T = c10::BFloat16;
  using W = float;
  static constexpr int64_t kStep = 1;
  static void weights(const W* p, __m256& w0, __m256& w1) { F32Panel::weights(p, w0, w1); }
};
constexpr int64_t kWidenRows = 2 * kRowBlock;

// one panel's sums (sum[r][at], sum[r][at + 1]) of rows [0, R) plus the bias `b` (zeros where there is none),
// columns [0, cols) stored into y (row stride N)
template <class P, int R, int S>
inline void store_sums(const __m256 (&sum)[R][S], int at, const float* b, int64_t cols, typename P::T* y, int64_t N) {
  const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m256 lo = _mm256_add_ps(sum[r][at], b0), hi = _mm256_add_ps(sum[r][at + 1], b1);
    if constexpr (std::is_same_v<typename P::T, float>) {
      if (cols == kPanel) {
        _mm256_storeu_ps(y + r * N, lo);
        _mm256_storeu_ps(y + r * N + 8, hi);
        continue;
      }
    }
    // bf16 (rounded to nearest even, as torch rounds), or a weight's last panel of fewer outputs
    alignas(32) float out[kPanel];
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
    for (int64_t c = 0; c < cols; ++c) y[r * N + c] = typename P::T(out[c]);
  }
}

// rows [0, R) of x (f32, row stride K) times Q neighbouring panels (`size` elements apart; the last one's columns
// [0, cols) real, the others whole), into y (row stride N)
template <class P, int R, int Q = 1>
inline void pass(const float* x, int64_t K, const typename P::W* panel, const typename P::T* bias, int64_t cols,
                 typename P::T* y, int64_t N, int64_t size = 0) {
  // the row loops unrolled by the front end: left to later passes, GCC kept the sums in registers but stored
  // all twelve to the stack every k as well, and the 8-row product ran 1.4x slower
  __m256 sum[R][2 * Q];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int q = 0; q < 2 * Q; ++q) sum[r][q] = _mm256_setzero_ps();
  // the panels' lines 2 KiB ahead, asked for as not to be kept, as the AVX-512 pass asks (this build run on a Zen 4
  // CPU, SmolLM2's shapes, in one process with and without: f32 at 8 rows 1.4x as fast, at 16 1.3x, at 64 1.1x; bf16
  // at 1, 2 and 8 rows 1.15x, 1.2x and 1.37x; 1 KiB ahead gained less). Not for f32 at one or two rows (2-6% slower
  // there), nor for a bf16 panel widened into this thread's own buffer, which is read again
  constexpr bool ahead = std::is_same_v<P, Bf16Panel> || (std::is_same_v<P, F32Panel> && R > 2);
  for (int64_t k = 0; k < K; ++k, panel += kPanel) {
    if constexpr (ahead) {
#pragma GCC unroll 16
      for (int q = 0; q < Q; ++q) _mm_prefetch(reinterpret_cast<const char*>(panel + q * size) + 2048, _MM_HINT_NTA);
    }
    __m256 w[2 * Q];
#pragma GCC unroll 16
    for (int q = 0; q < Q; ++q) P::weights(panel + q * size, w[2 * q], w[2 * q + 1]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 16
      for (int q = 0; q < 2 * Q; ++q) sum[r][q] = _mm256_fmadd_ps(xr, w[q], sum[r][q]);
    }
  }
#pragma GCC unroll 16
  for (int q = 0; q < Q; ++q) {
    const int64_t real = q == Q - 1 ? cols : kPanel;
    alignas(32) float b[kPanel] = {};
    if (bias)
      for (int64_t c = 0; c < real; ++c) b[c] = float(bias[q * kPanel + c]);
    store_sums<P, R>(sum, 2 * q, b, real, y + q * kPanel, N);
  }
}

#else
#define STER_PANELS 0
#endif

#if STER_PANELS
// the rows after the last whole block: fewer than kRowBlock, in one pass
template <class P, class X, int R = 1>
inline void rest(int64_t left, const X* x, int64_t K, const typename P::W* panel, const typename P::T* bias,
                 int64_t cols, typename P::T* y, int64_t N) {
  if constexpr (R < kRowBlock) {
    if (left == R) return pass<P, R>(x, K, panel, bias, cols, y, N);
    rest<P, X, R + 1>(left, x, K, panel, bias, cols, y, N);
  }
}

// x of the weight's type, or f32 where the panel widens bf16 as it reads (AVX2)
template <class P, class X = typename P::T>
void product(const X* x, int64_t M, int64_t K, const typename P::T* panels, const typename P::T* bias,
             typename P::T* y, int64_t N) {
  const int64_t count = (N + kPanel - 1) / kPanel, size = (K + P::kStep - 1) / P::kStep * P::kStep * kPanel;
  // panels are dealt to the threads; each reads its panel from memory once and again from its cache for every
  // further block of rows
  at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
#if !defined(__AVX512F__)
    // (bf16 with AVX2, many rows) this thread's panel widened to f32, its room kept from call to call
    thread_local at::Tensor wide;
#endif
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * kPanel, cols = std::min(kPanel, N - c0);
      const typename P::T* panel = panels + p * size;
      const typename P::T* b = bias ? bias + c0 : nullptr;
#if !defined(__AVX512F__)
      if constexpr (std::is_same_v<P, Bf16Panel>) {
        if (M >= kWidenRows) {
          if (!wide.defined() || wide.numel() < K * kPanel)
            wide = at::empty({K * kPanel}, at::kFloat);  // torch's allocator: 64-byte aligned
          float* to = wide.data_ptr<float>();
          for (int64_t k = 0; k < K; ++k) {  // (asked for ahead as the passes ask: 1.01-1.05x at 12-64 rows)
            __m256 w0, w1;
            _mm_prefetch(reinterpret_cast<const char*>(panel + k * kPanel) + 2048, _MM_HINT_NTA);
            P::weights(panel + k * kPanel, w0, w1);
            _mm256_store_ps(to + k * kPanel, w0);
            _mm256_store_ps(to + k * kPanel + 8, w1);
          }
          int64_t m = 0;
          for (; m + kRowBlock <= M; m += kRowBlock)
            pass<Bf16Widened, kRowBlock>(x + m * K, K, to, b, cols, y + m * N + c0, N);
          rest<Bf16Widened, X>(M - m, x + m * K, K, to, b, cols, y + m * N + c0, N);
          continue;
        }
      }
      // one or two rows: two panels at once. A row's sums are chains of dependent multiply-adds (4 cycles each
      // here), and two sums a row left bf16 panels waiting on them rather than on memory; a second panel's
      // sums are another output's, so each sum is still the same chain in the same order (the same bits)
      if (M <= 2 && p + 1 < p1) {
        const int64_t real = std::min(kPanel, N - c0 - kPanel);
        if (M == 1) pass<P, 1, 2>(x, K, panel, b, real, y + c0, N, size);
        else pass<P, 2, 2>(x, K, panel, b, real, y + c0, N, size);
        ++p;
        continue;
      }
#endif
      int64_t m = 0;
      for (; m + kRowBlock <= M; m += kRowBlock) pass<P, kRowBlock>(x + m * K, K, panel, b, cols, y + m * N + c0, N);
      rest<P, X>(M - m, x + m * K, K, panel, b, cols, y + m * N + c0, N);
    }
  });
}
#endif

#if !STER_PANELS
constexpr int64_t kPanel = 32;  // (never laid out: no AVX2 or AVX-512)
#endif

#if (defined(__AVX512F__) && defined(__AVX512BF16__)) || (!defined(__AVX512F__) && STER_PANELS)
constexpr bool kBf16Panels = true;
#else
constexpr bool kBf16Panels = false;  // AVX-512 without AVX512_BF16: oneDNN multiplies bf16 there
#endif
// input columns a bf16 panel row holds: AVX512_BF16's pairs, or one (AVX2)
#if defined(__AVX512F__)
constexpr int64_t kBf16Step = 2;
#else
constexpr int64_t kBf16Step = 1;
#endif

// which dtypes this build lays out in panels: 1 f32, 2 bf16, 3 both
int64_t panel_dtypes() { return (STER_PANELS ? 1 : 0) | (kBf16Panels ? 2 : 0); }

bool takes(at::ScalarType dtype) {
  return (dtype == at::kFloat && (panel_dtypes() & 1)) || (dtype == at::kBFloat16 && (panel_dtypes() & 2));
}

// the panels' shape for weight [N, K]: [ceil(N / P), ceil(K / s), P, s] (P = kPanel; s = 1, or 2 for bf16 pairs)
std::vector<int64_t> panel_shape(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_panels: a 2-D CPU weight");
  TORCH_CHECK(takes(weight.scalar_type()), "pack_panels: this build lays out ",
              panel_dtypes() ? "f32 only" : "no dtype (neither AVX2 nor AVX-512)", ", not ", weight.scalar_type());
  const int64_t step = weight.scalar_type() == at::kFloat ? 1 : kBf16Step;
  return {(weight.size(0) + kPanel - 1) / kPanel, (weight.size(1) + step - 1) / step, kPanel, step};
}

int64_t panel_bytes(const at::Tensor& weight) {
  const std::vector<int64_t> shape = panel_shape(weight);
  return shape[0] * shape[1] * shape[2] * shape[3] * static_cast<int64_t>(weight.element_size());
}

// weight [N, K] -> its panels (panel_shape), zero-padded; written into `out` (panel_bytes bytes) where given
at::Tensor pack_panels(const at::Tensor& weight, const std::optional<at::Tensor>& out) {
  const std::vector<int64_t> shape = panel_shape(weight);
  const int64_t count = shape[0], pairs = shape[1], step = shape[3], N = weight.size(0), K = weight.size(1);
  // the panels' rows are loaded as whole aligned registers: pad the columns, and pad the K dimension to pairs
  at::Tensor w = at::zeros({count * kPanel, pairs * step}, weight.options());
  w.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  at::Tensor laid = w.view({count, kPanel, pairs, step}).permute({0, 2, 1, 3});  // [count, pairs, 32, step]
#if STER_PANELS && !defined(__AVX512F__)
  if (weight.scalar_type() == at::kBFloat16)  // in the order Bf16Panel::weights unpacks
    laid = laid.index_select(2, at::tensor(std::vector<int64_t>(kBf16Order, kBf16Order + kPanel), at::kLong));
#endif
  if (!out.has_value()) return laid.contiguous();
  TORCH_CHECK(out->is_contiguous() && out->nbytes() == static_cast<size_t>(panel_bytes(weight)),
              "pack_panels: out is not ", panel_bytes(weight), " contiguous bytes");
  return out->view(weight.scalar_type()).view(shape).copy_(laid);
}

// x [..., K] times the weight whose panels these are ([count, pairs, 32, step]), N its outputs, into `out` where
// defined (entries.h)
at::Tensor panel_product_into(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                              int64_t N, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && panels.dim() == 4 && panels.is_contiguous(),
              "panel_product: CPU tensors, panels as pack_panels lays them out");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type() && takes(x.scalar_type()),
              "panel_product: x and panels of one dtype this build lays out");
  const int64_t K = x.size(-1), step = panels.size(3);
  TORCH_CHECK(panels.size(2) == kPanel && step == (x.scalar_type() == at::kFloat ? 1 : kBf16Step) &&
                  panels.size(1) == (K + step - 1) / step && N > (panels.size(0) - 1) * kPanel &&
                  N <= panels.size(0) * kPanel,
              "panel_product: panels of another shape than x's ", K, " inputs and ", N, " outputs");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0, "panel_product: panels not 64-byte aligned");
  const auto [flat, y, b] = operands(x, N, bias, "panel_product", out);
  if (flat.size(0) == 0 || N == 0) return y;
#if STER_PANELS
  if (x.scalar_type() == at::kFloat)
    product<F32Panel>(flat.data_ptr<float>(), flat.size(0), K, panels.data_ptr<float>(),
                      b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
#if defined(__AVX512BF16__)
  else
    product<Bf16Panel>(flat.data_ptr<c10::BFloat16>(), flat.size(0), K, panels.data_ptr<c10::BFloat16>(),
                       b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), N);
#elif !defined(__AVX512F__)
  else  // x widened once here, not once per panel it meets (exact: the same products)
    product<Bf16Panel, float>(ster_kernels::widened(flat), flat.size(0), K,
                              panels.data_ptr<c10::BFloat16>(), b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr,
                              y.data_ptr<c10::BFloat16>(), N);
#endif
#endif
  return y;
}

at::Tensor panel_product(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t N) {
  return panel_product_into(x, panels, bias, N, at::Tensor());
}

// ---- the packed weights of a process, found without Python ------------------------------------------------
//
// A compiled step hands a product its weight, the parameter itself. Finding that weight's packed copy through an
// operator whose body is Python cost 13-30 us a product, as much as a one-row product's own time, and 10% of a
// 12- or 32-row step's products on an AVX2 CPU (bench/products.py); here the copies are held by the weight's
// address, shape, strides and dtype (parallel/packed.py holds and drops them, with the weight's life) and
// checked against the version the weight had when packed: a weight changed in place since is read plain, and
// its entry dropped. A copy is this file's panels, or oneDNN's reorder of the weight (where its dtype has no
// panels), or oneDNN's reorder of an f32 copy of a bf16 weight (bf16 products not native: `widened`).
enum class Layout { kPanels, kOnednn, kOnednnWidened };

struct Held {
  at::Tensor copy;
  Layout layout;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t version;  // -1: an inference tensor, which counts no versions
};
std::mutex held_lock;
std::unordered_map<const void*, Held> held;

int64_t version_of(const at::Tensor& t) {
  const auto& counter = t.unsafeGetTensorImpl()->version_counter();
  return counter.enabled() ? static_cast<int64_t>(counter.current_version()) : -1;
}

void hold(const at::Tensor& weight, const at::Tensor& copy, Layout layout) {
  std::lock_guard<std::mutex> guard(held_lock);
  held[weight.data_ptr()] = Held{copy, layout, weight.sizes().vec(), weight.strides().vec(), weight.scalar_type(),
                                 version_of(weight)};
}

void hold_panels(const at::Tensor& weight, const at::Tensor& panels) {
  TORCH_CHECK(weight.dim() == 2 && panels.dim() == 4 && panels.scalar_type() == weight.scalar_type() &&
                  panels.size(0) == (weight.size(0) + kPanel - 1) / kPanel,
              "hold_panels: panels that pack_panels did not make of this weight");
  hold(weight, panels, Layout::kPanels);
}

void hold_onednn(const at::Tensor& weight, const at::Tensor& reordered, bool widened) {
  TORCH_CHECK(weight.dim() == 2 && reordered.dim() == 2 && reordered.sizes() == weight.sizes() &&
                  reordered.scalar_type() == (widened ? at::kFloat : weight.scalar_type()),
              "hold_onednn: a reordered copy of this weight's shape, in f32 where widened");
  hold(weight, reordered, widened ? Layout::kOnednnWidened : Layout::kOnednn);
}

void drop_held(int64_t address) {
  std::lock_guard<std::mutex> guard(held_lock);
  held.erase(reinterpret_cast<const void*>(address));
}

int64_t held_count() {
  std::lock_guard<std::mutex> guard(held_lock);
  return static_cast<int64_t>(held.size());
}

using Product = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using Pointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             c10::string_view, c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);

// oneDNN's matmul (mkldnn::_linear_pointwise, the operator torch's own packed linear runs) over a reordered copy,
// which only a torch with oneDNN makes
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& reordered, const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<Pointwise>();
  return op.call(x, reordered, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

std::optional<at::Tensor> in_f32(const std::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return std::nullopt;
  return bias->to(at::kFloat);
}

}  // namespace

// x W^T (+ b): over W's packed copy where one is held and current, else as dense() would on the plain weight
at::Tensor ster_kernels::packed_product(const at::Tensor& x, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  // where a library computes the product, its result is copied into `out`: only this file's kernels and
  // few_rows.cpp's write there directly
  const auto into = [&out](const at::Tensor& y) { return out.defined() ? out.copy_(y) : y; };
  at::Tensor copy;
  Layout layout = Layout::kPanels;
  {
    std::lock_guard<std::mutex> guard(held_lock);
    const auto found = held.find(weight.data_ptr());
    if (found != held.end() && found->second.dtype == weight.scalar_type() && weight.sizes() == found->second.sizes &&
        weight.strides() == found->second.strides) {
      if (found->second.version == version_of(weight)) copy = found->second.copy, layout = found->second.layout;
      else held.erase(found);  // changed in place since it was packed
    }
  }
  if (copy.defined() && x.scalar_type() == weight.scalar_type()) {
    if (layout == Layout::kPanels) return panel_product_into(x, copy, bias, weight.size(0), out);
    if (layout == Layout::kOnednn) return into(onednn_linear(x, copy, bias));
    return into(onednn_linear(x.to(at::kFloat), copy, in_f32(bias)).to(x.scalar_type()));
  }
  const int64_t K = x.size(-1), rows = K ? x.numel() / K : 0;
  if (rows >= 1 && rows <= 8 && weight.dim() == 2 && weight.is_contiguous() &&
      x.scalar_type() == weight.scalar_type() &&
      (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
      (!bias.has_value() || !bias->defined() || bias->scalar_type() == x.scalar_type())) {
    return few_rows_into(x, weight, bias, out);
  }
  // more rows over a weight not held (never packed, or changed since): dense()'s own fallbacks, in
  // parallel/linear.py's cpu_linear (a half weight widened block by block where half products are not native,
  // oneDNN on the plain weight), the operator that module defines before it calls this one (looked up each time:
  // a caller of its own, bench/products.py, may come first)
  const auto schema = c10::Dispatcher::singleton().findSchema({"ster_dist::cpu_linear", ""});
  return into(schema.has_value() ? schema->typed<Product>().call(x, weight, bias) : at::linear(x, weight, bias));
}

namespace {

at::Tensor packed_product_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return ster_kernels::packed_product(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("panel_dtypes() -> int", &panel_dtypes);
  m.def("panel_bytes(Tensor weight) -> int", &panel_bytes);
  m.def("pack_panels(Tensor weight, Tensor? out=None) -> Tensor");
  m.def("panel_product(Tensor x, Tensor panels, Tensor? bias, int N) -> Tensor");
  m.def("hold_panels(Tensor weight, Tensor panels) -> ()", &hold_panels);
  m.def("hold_onednn(Tensor weight, Tensor reordered, bool widened) -> ()", &hold_onednn);
  m.def("drop_held(int address) -> ()", &drop_held);
  m.def("held_count() -> int", &held_count);
  m.def("packed_product(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_product", &panel_product);
  m.impl("packed_product", &packed_product_op);
}
