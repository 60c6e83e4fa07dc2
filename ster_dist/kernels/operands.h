// The operands of a product y = x W^T (+ b) as this package's product kernels take them (few_rows.cpp,
// panels.cpp): x's rows as one contiguous [rows, K] block, y of x's shape with N last (the caller's `out` where it
// gives one: a native step's room, kept from step to step), the bias contiguous.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace ster_kernels {

struct Operands {
  at::Tensor rows, y, bias;  // bias undefined where there is none
};

inline Operands operands(const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias, const char* kernel,
                         const at::Tensor& out = at::Tensor()) {
  Operands o;
  o.rows = x.reshape({-1, x.size(-1)}).contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  if (out.defined()) {
    TORCH_CHECK(out.sizes() == at::IntArrayRef(sizes) && out.scalar_type() == x.scalar_type() && out.is_contiguous(),
                kernel, ": out is not a contiguous tensor of x's shape with N last, in x's dtype");
    o.y = out;
  } else {
    o.y = at::empty(sizes, x.options());
  }
  if (bias.has_value() && bias->defined()) {
    o.bias = bias->contiguous();
    TORCH_CHECK(o.bias.scalar_type() == x.scalar_type() && o.bias.numel() == N, kernel,
                ": a bias of N elements in x's dtype");
  }
  return o;
}

// bf16 rows [rows, K] widened to f32 (exact) in room the calling thread keeps, so a product that widens x once
// allocates nothing a call; valid until this thread's next call
inline const float* widened(const at::Tensor& rows) {
  thread_local std::vector<float> room;
  const int64_t n = rows.numel();
  if ((int64_t)room.size() < n) room.resize(n);
  const c10::BFloat16* from = rows.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < n; ++i) room[i] = static_cast<float>(from[i]);
  return room.data();
}

}  // namespace ster_kernels
