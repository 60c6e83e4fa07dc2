// y = x W^T (+ b) for a few rows of x (decode): each weight row is read once, front to back, for all rows of x.
// Built with the package's other kernels at first use, for the CPU it runs on (kernels/__init__.py).
//
// Why a kernel of our own: at one to eight rows the library kernels are slow on the weights of a decode step.
// oneDNN repacks a bf16 weight on every call and MKL's f32 matrix-vector product reaches half the memory
// bandwidth on a non-Intel CPU. Here each thread streams its own contiguous share of the weight's rows, so the
// hardware prefetcher sees one stream: per-row blocks of several rows read side by side (four short streams
// at a time) ran at half the speed on rows of 576 elements. bf16 rows multiply through AVX512_BF16's pairwise
// product (vdpbf16ps) where the CPU has it, accumulating in f32 as every bf16 kernel does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "entries.h"
#include "lanes.h"
#include "operands.h"
#include "rows.h"

namespace {

using namespace ster_kernels;

constexpr int64_t kMaxRows = 8;

#if STER_KERNELS_ISA
template <class V>
void bf16_rows(int64_t M, const at::Tensor& flat, const at::Tensor& weight, const at::Tensor& b, const at::Tensor& y,
               int64_t N, int64_t K) {
  const auto* w = weight.data_ptr<c10::BFloat16>();
  const auto* bias = b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr;
  if constexpr (V::kWidens) {
    // x widened to f32 once here, not once per weight row it meets: on AVX2 that widening was most of the work
    // at eight rows (bench/products.py). Exact, so the sums are the same bits.
    by_count<V, float>(M, widened(flat), w, bias, y.data_ptr<c10::BFloat16>(), N, K);
  } else {
    by_count<V>(M, flat.data_ptr<c10::BFloat16>(), w, bias, y.data_ptr<c10::BFloat16>(), N, K);
  }
}
#endif

}  // namespace

at::Tensor ster_kernels::few_rows_into(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(STER_KERNELS_ISA, "few_rows: built without AVX2 or AVX-512");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "few_rows: CPU tensors only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "few_rows: a contiguous 2-D weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "few_rows: x and weight both f32 or both bf16");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "few_rows: x's last dimension is not the weight's");
  const auto [flat, y, b] = operands(x, N, bias, "few_rows", out);
  const int64_t M = flat.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "few_rows: 1 to 8 rows");
#if STER_KERNELS_ISA
  if (x.scalar_type() == at::kFloat)
    by_count<F32Stream>(M, flat.data_ptr<float>(), weight.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                       y.data_ptr<float>(), N, K);
  else
    bf16_rows<Bf16Lanes>(M, flat, weight, b, y, N, K);
#endif
  return y;
}

namespace {

at::Tensor few_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return ster_kernels::few_rows_into(x, weight, bias, at::Tensor());
}

// 2: AVX-512 (bf16 pairs natively where `bf16_pairs`), 1: AVX2 with FMA, 0: neither (never called)
int64_t isa() { return STER_KERNELS_ISA; }

#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif
bool bf16_pairs() { return kBf16Pairs; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("few_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("isa() -> int", &isa);
  m.def("bf16_pairs() -> bool", &bf16_pairs);
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) { m.impl("few_rows", &few_rows); }
