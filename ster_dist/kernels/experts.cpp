// A step's routed SwiGLU experts: each busy expert's silu(x G^T) * (x U^T) then D, its rows together, eight at a
// time, so each matrix is read once for every eight of its rows (moe/experts.py sends plain SwiGLU experts of f32
// or bf16 here: f32 up to 512 rows, past which grouped_mm's blocked products are ahead, bf16 at any count on a CPU
// without bf16 products, where grouped_mm widens every matrix on every call).
//
// Why: at decode a MoE layer ran, in Python, a sort of its rows by expert, a loop over every local expert and
// three products, an activation and a scatter for each busy one, about 0.4 ms a layer on bench/moe.py's model
// (16 experts of 512 x 512, top-2) against the products' own 0.15. Rounding follows the Python path: each
// product rounded to the weights' dtype, then silu, then the product with up, each rounded likewise.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lanes.h"
#include "rows.h"

namespace {

using namespace ster_kernels;

#if STER_KERNELS_ISA
template <class V>
void run(const at::Tensor& x, const int64_t* ids, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
         at::Tensor& out) {
  using T = typename V::T;
  constexpr int64_t kChunk = 8;  // the most rows by_count takes
  const int64_t m = x.size(0), hidden = x.size(1), inner = gate.size(1);
  std::vector<T> rows(kChunk * hidden), g(kChunk * inner), u(kChunk * inner), y(kChunk * hidden);
  std::vector<int64_t> members;
  std::vector<bool> done(m, false);
  const T* xs = x.data_ptr<T>();
  T* os = out.data_ptr<T>();
  for (int64_t first = 0; first < m; ++first) {  // experts in the order their first row comes
    if (done[first]) continue;
    const int64_t e = ids[first];
    members.clear();
    for (int64_t r = first; r < m; ++r)
      if (ids[r] == e) {
        members.push_back(r);
        done[r] = true;
      }
    for (size_t at = 0; at < members.size(); at += kChunk) {
      const int64_t c = std::min<int64_t>(kChunk, members.size() - at);
      const int64_t* chunk = members.data() + at;
      for (int64_t j = 0; j < c; ++j) std::copy_n(xs + chunk[j] * hidden, hidden, rows.data() + j * hidden);
      by_count<V>(c, rows.data(), gate.data_ptr<T>() + e * inner * hidden, nullptr, g.data(), inner, hidden);
      by_count<V>(c, rows.data(), up.data_ptr<T>() + e * inner * hidden, nullptr, u.data(), inner, hidden);
      for (int64_t i = 0; i < c * inner; ++i) {
        const float a = static_cast<float>(g[i]);
        const T act = T(a / (1.f + std::exp(-a)));
        g[i] = T(static_cast<float>(act) * static_cast<float>(u[i]));
      }
      by_count<V>(c, g.data(), down.data_ptr<T>() + e * hidden * inner, nullptr, y.data(), hidden, inner);
      for (int64_t j = 0; j < c; ++j) std::copy_n(y.data() + j * hidden, hidden, os + chunk[j] * hidden);
    }
  }
}
#endif

// x [m, hidden] (m >= 1 rows), ids [m] each row's expert; gate and up [experts, inner, hidden], down [experts, hidden,
// inner], all contiguous and of x's dtype (f32 or bf16). Returns [m, hidden]: row r through expert ids[r].
at::Tensor swiglu_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gate, const at::Tensor& up,
                            const at::Tensor& down) {
  TORCH_CHECK(STER_KERNELS_ISA, "swiglu_experts: built without AVX2 or AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "swiglu_experts: x [rows, hidden], at least one row");
  TORCH_CHECK(gate.dim() == 3 && up.sizes() == gate.sizes() && down.dim() == 3 && down.size(0) == gate.size(0) &&
                  down.size(1) == x.size(1) && down.size(2) == gate.size(1) && gate.size(2) == x.size(1),
              "swiglu_experts: gate and up [experts, inner, hidden], down [experts, hidden, inner]");
  TORCH_CHECK(x.scalar_type() == gate.scalar_type() && up.scalar_type() == gate.scalar_type() &&
                  down.scalar_type() == gate.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "swiglu_experts: x and the weights all f32 or all bf16");
  TORCH_CHECK(gate.is_contiguous() && up.is_contiguous() && down.is_contiguous(), "swiglu_experts: contiguous weights");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.numel() == x.size(0), "swiglu_experts: int64 ids, one a row");
  const at::Tensor xc = x.contiguous(), idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r)
    TORCH_CHECK(0 <= id[r] && id[r] < gate.size(0), "swiglu_experts: expert ", id[r], " outside the ", gate.size(0));
  at::Tensor out = at::empty_like(xc);
#if STER_KERNELS_ISA
  if (x.scalar_type() == at::kFloat)
    run<F32Stream>(xc, id, gate, up, down, out);
  else
    run<Bf16Lanes>(xc, id, gate, up, down, out);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("swiglu_experts(Tensor x, Tensor ids, Tensor gate, Tensor up, Tensor down) -> Tensor");
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) { m.impl("swiglu_experts", &swiglu_experts); }
