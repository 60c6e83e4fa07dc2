// What one kernel file calls of another's (stack.cpp of panels.cpp and paged_decode.cpp): the same functions
// their operators run, so a step through either way computes the same sums.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace ster_kernels {

// Each writes its result into `out` where that is defined (x's shape with the outputs last, contiguous, of the
// result's dtype: a native step's room, kept from step to step, so its products allocate nothing), else into a
// new tensor; either is returned.

// x W^T (+ b) over W's packed copy where one is held and current, else as dense() would on the plain weight
// (panels.cpp's packed_product operator)
at::Tensor packed_product(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& out = at::Tensor());

// x W^T (+ b) for one to eight rows of x over the plain weight (few_rows.cpp's few_rows operator)
at::Tensor few_rows_into(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& out);

// rows of one query each (q [rows, heads, d], their new keys and values k [rows, kv_heads, d], v [rows, kv_heads,
// dv]) through layer `index` of the decode plan in force: k and v stored where the plan says, then attention
// over every key of each row ([rows, heads, dv]); undefined where no plan covers the layer (paged_decode.cpp)
at::Tensor planned_rows(int64_t index, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out = at::Tensor());

}  // namespace ster_kernels
