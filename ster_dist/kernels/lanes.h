// SIMD steps shared by the kernels of this package (few_rows.cpp, experts.cpp, paged_decode.cpp, causal_attend.cpp):
// the instruction set is picked when the extension is compiled for this CPU (-march=native, kernels/__init__.py).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace ster_kernels {

// One SIMD step of a row: `In` is what a load gives, `Acc` the f32 accumulator, `W` elements per step.
#if defined(__AVX2__) && defined(__FMA__)
static inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
struct F32Half {  // f32 in 256-bit steps: AVX2's lanes, and AVX-512's where half-width steps stream faster
  using T = float; using In = __m256; using Acc = __m256;
  static constexpr int W = 8;
  static In load(const float* p) { return _mm256_loadu_ps(p); }
  static Acc madd(Acc acc, In x, In w) { return _mm256_fmadd_ps(x, w, acc); }
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float sum(Acc a) { return sum8(a); }
  // whole-register steps of a softmax over tiles (causal_attend.cpp)
  static void store(float* p, Acc x) { _mm256_storeu_ps(p, x); }
  static Acc set1(float x) { return _mm256_set1_ps(x); }
  static Acc sub(Acc a, Acc b) { return _mm256_sub_ps(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm256_mul_ps(a, b); }
  static Acc max(Acc a, Acc b) { return _mm256_max_ps(a, b); }
  static float top(Acc a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
};
#endif

#if defined(__AVX512F__)
struct F32Lanes {
  using T = float; using In = __m512; using Acc = __m512;
  static constexpr int W = 16;
  static In load(const float* p) { return _mm512_loadu_ps(p); }
  static Acc madd(Acc acc, In x, In w) { return _mm512_fmadd_ps(x, w, acc); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float sum(Acc a) { return _mm512_reduce_add_ps(a); }
  // whole-register steps of a softmax over tiles (causal_attend.cpp)
  static void store(float* p, Acc x) { _mm512_storeu_ps(p, x); }
  static Acc set1(float x) { return _mm512_set1_ps(x); }
  static Acc sub(Acc a, Acc b) { return _mm512_sub_ps(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm512_mul_ps(a, b); }
  static Acc max(Acc a, Acc b) { return _mm512_max_ps(a, b); }
  static float top(Acc a) { return _mm512_reduce_max_ps(a); }
};
#if defined(__AVX512BF16__)
struct Bf16Lanes {
  using T = c10::BFloat16; using In = __m512i; using Acc = __m512;
  static constexpr int W = 32;
  static constexpr bool kWidens = false;
  static In load(const T* p) { return _mm512_loadu_si512(p); }
  static Acc madd(Acc acc, In x, In w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float sum(Acc a) { return _mm512_reduce_add_ps(a); }
};
#else
struct Bf16Lanes {  // widened to f32 as read: a bf16 is the top half of an f32
  using T = c10::BFloat16; using In = __m512; using Acc = __m512;
  static constexpr int W = 16;
  static constexpr bool kWidens = true;  // loads f32 as they are (load_f32): x widened once, not per weight row
  static In load(const T* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static In load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static Acc madd(Acc acc, In x, In w) { return _mm512_fmadd_ps(x, w, acc); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float sum(Acc a) { return _mm512_reduce_add_ps(a); }
};
#endif
// f32 rows streamed from memory (few_rows.cpp, experts.cpp) in 256-bit steps where the CPU runs a 512-bit
// operation as two 256-bit halves (AMD's Zen 4, which GCC 12 names znver3 and later ones znver4): there SmolLM2's
// batch-1 products read 5-16% faster than in 512-bit steps, alternating in one process (bench/README.md).
#if defined(__znver3__) || defined(__znver4__)
using F32Stream = F32Half;
#else
using F32Stream = F32Lanes;
#endif
#define STER_KERNELS_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
using F32Lanes = F32Half;
struct Bf16Lanes {
  using T = c10::BFloat16; using In = __m256; using Acc = __m256;
  static constexpr int W = 8;
  static constexpr bool kWidens = true;
  static In load(const T* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static In load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static Acc madd(Acc acc, In x, In w) { return _mm256_fmadd_ps(x, w, acc); }
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float sum(Acc a) { return sum8(a); }
};
using F32Stream = F32Half;
#define STER_KERNELS_ISA 1
#else
#define STER_KERNELS_ISA 0  // no kernel: kernels/__init__.py reports the build unusable
#endif

#if defined(__AVX512F__)
// exp(x) for x <= 0 as Cephes' expf computes it: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial
// (within 2 ulp), times 2^n. Below -87.3 it returns exp(-87.3), about 1e-38: nothing a softmax keeps.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// s[i] = exp(s[i] - top) for i < count; returns their sum
inline float exp_shifted(float* s, int64_t count, float top) {
  __m512 total = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
    _mm512_storeu_ps(s + i, e);
    total = _mm512_add_ps(total, e);
  }
  if (i < count) {
    const __mmask16 left = (__mmask16)((1u << (count - i)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(left, s + i), shift));
    _mm512_mask_storeu_ps(s + i, left, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(left, e));
  }
  return _mm512_reduce_add_ps(total);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

inline float exp_shifted(float* s, int64_t count, float top) {
  __m256 total = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
    _mm256_storeu_ps(s + i, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = sum8(total);
  if (i < count) {  // the last few through one padded step: the same polynomial as every other element
    alignas(32) float tail[8] = {top, top, top, top, top, top, top, top};
    for (int64_t j = i; j < count; ++j) tail[j - i] = s[j];
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(tail), shift));
    _mm256_store_ps(tail, e);
    for (int64_t j = i; j < count; ++j) {
      s[j] = tail[j - i];
      sum += tail[j - i];
    }
  }
  return sum;
}
#endif

#if STER_KERNELS_ISA
// One step of x: of the weight's type, or f32 for lanes that widen bf16 to f32 as they read it (x widened once
// by the caller, exactly, so the sums are the same bits).
template <class V, class X>
inline typename V::In x_step(const X* p) {
  if constexpr (std::is_same_v<X, typename V::T>) return V::load(p);
  else return V::load_f32(p);
}

// out[m] = x[m] . w for one weight row w of K elements and M rows of x ([M, K]). U accumulators a row of x
// so that consecutive multiply-adds do not wait on each other's result.
template <class V, int M, int U, class X = typename V::T>
inline void one_row(const X* x, const typename V::T* w, int64_t K, float* out) {
  typename V::Acc acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = V::zero();
  int64_t k = 0;
  for (; k + V::W * U <= K; k += V::W * U)
    for (int u = 0; u < U; ++u) {
      auto wv = V::load(w + k + V::W * u);
      for (int m = 0; m < M; ++m) acc[m][u] = V::madd(acc[m][u], x_step<V>(x + m * K + k + V::W * u), wv);
    }
  for (; k + V::W <= K; k += V::W) {
    auto wv = V::load(w + k);
    for (int m = 0; m < M; ++m) acc[m][0] = V::madd(acc[m][0], x_step<V>(x + m * K + k), wv);
  }
  for (int m = 0; m < M; ++m) {
    auto total = acc[m][0];
    for (int u = 1; u < U; ++u) total = V::add(total, acc[m][u]);
    float s = V::sum(total);
    for (int64_t j = k; j < K; ++j) s += float(x[m * K + j]) * float(w[j]);
    out[m] = s;
  }
}
#endif  // STER_KERNELS_ISA

}  // namespace ster_kernels
