// The operands of a product y = x W^T (+ b) as this package's product kernels take them (few_rows.cpp,
// panels.cpp): x's rows as one contiguous [rows, K] block, y of x's shape with N last, the bias contiguous.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace ster_kernels {

struct Operands {
  at::Tensor rows, y, bias;  // bias undefined where there is none
};

inline Operands operands(const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias, const char* kernel) {
  Operands o;
  o.rows = x.reshape({-1, x.size(-1)}).contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  o.y = at::empty(sizes, x.options());
  if (bias.has_value() && bias->defined()) {
    o.bias = bias->contiguous();
    TORCH_CHECK(o.bias.scalar_type() == x.scalar_type() && o.bias.numel() == N, kernel,
                ": a bias of N elements in x's dtype");
  }
  return o;
}

}  // namespace ster_kernels
