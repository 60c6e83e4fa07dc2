// y = x W^T for a few rows of x (decode), streaming W once at the memory's bandwidth.
//
// torch's CPU product of one row runs MKL's matrix-vector kernel, which on a non-Intel AVX2 CPU reads an f32
// weight at about half the bandwidth the memory gives (bench/decode.py). Here every thread of torch's pool
// takes a contiguous share of W's rows and reads them once, a few rows at a time, with the rows of x held in
// registers; bf16 weights are widened to f32 as they load (exact), so a bf16 model reads half the bytes.
// Sums are kept in f32 and the result is cast to x's dtype, as torch's own bf16 product does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

namespace {

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// out[r * m + o] for o in [first, last): R rows of x (f32, [R, n]) against W ([m, n] of T), B output rows at once
template <typename T, int R, int B>
void rows(const T* w, const float* x, float* out, int64_t first, int64_t last, int64_t n, int64_t m) {
  const int64_t body = n - n % 8;
  int64_t o = first;
  for (; o + B <= last; o += B) {
    __m256 acc[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
    const T* row = w + o * n;
    for (int64_t i = 0; i < body; i += 8) {
      __m256 wv[B];
      for (int b = 0; b < B; ++b) wv[b] = load8(row + b * n + i);
      for (int r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(x + r * n + i);
        for (int b = 0; b < B; ++b) acc[r][b] = _mm256_fmadd_ps(wv[b], xv, acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) {
        float s = sum8(acc[r][b]);
        for (int64_t i = body; i < n; ++i) s += widen(row[b * n + i]) * x[r * n + i];
        out[r * m + o + b] = s;
      }
  }
  if (o < last) rows<T, R, 1>(w, x, out, o, last, n, m);
}

template <typename T, int R>
void product(const T* w, const float* x, float* out, int64_t n, int64_t m) {
  constexpr int B = R <= 2 ? 4 : 2;  // R x B accumulators and B weight loads stay within 16 registers
  // grain: a thread's share is at least 16k weights, so a small matrix is not cut finer than it pays to
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t first, int64_t last) {
    rows<T, R, B>(w, x, out, first, last, n, m);
  });
}

template <typename T>
void dispatch(const T* w, const float* x, float* out, int64_t rows_of_x, int64_t n, int64_t m) {
  switch (rows_of_x) {
    case 1: return product<T, 1>(w, x, out, n, m);
    case 2: return product<T, 2>(w, x, out, n, m);
    case 3: return product<T, 3>(w, x, out, n, m);
    default: return product<T, 4>(w, x, out, n, m);
  }
}

at::Tensor matrix_vector(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "matrix_vector: x [R, n], W [m, n]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "matrix_vector: 1 to 4 rows of x");
  TORCH_CHECK(weight.is_contiguous() && weight.device().is_cpu(), "matrix_vector: a contiguous CPU weight");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "matrix_vector: f32 or bf16 weights");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t r = xf.size(0), n = xf.size(1), m = weight.size(0);
  at::Tensor out = at::empty({r, m}, xf.options());
  if (weight.scalar_type() == at::kFloat)
    dispatch(weight.data_ptr<float>(), xf.data_ptr<float>(), out.data_ptr<float>(), r, n, m);
  else
    dispatch(weight.data_ptr<c10::BFloat16>(), xf.data_ptr<float>(), out.data_ptr<float>(), r, n, m);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(ster_kernels, m) { m.def("matrix_vector(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) { m.impl("matrix_vector", matrix_vector); }
