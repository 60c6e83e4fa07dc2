// y = x W^T (+ b) for one to eight rows of x, each weight row read once for all of them: the loop the few-row
// product (few_rows.cpp) and the experts' few-row feed-forward (experts.cpp) share.
#pragma once

#include <ATen/Parallel.h>

#include "lanes.h"

namespace ster_kernels {

#if STER_KERNELS_ISA
template <class V, int M, int M2 = 0, class X = typename V::T>
inline void rows(const X* x, const typename V::T* w, const typename V::T* b, typename V::T* y, int64_t N,
          int64_t K) {
  // two accumulators a row of x whatever M is, so a row's sum is the same sum in any batch (a request's
  // logits do not depend on who shares its step); at most 14 accumulators, within AVX2's 16 registers.
  // At eight rows (M2 > 0: four and four) a weight row is read for the first M rows, then again for the next M2
  // while it is still in the L1 cache: memory still sees each weight row once.
  constexpr int U = 2;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float out[M + M2];
    for (int64_t n = n0; n < n1; ++n) {
      one_row<V, M, U, X>(x, w + n * K, K, out);
      if constexpr (M2 > 0) one_row<V, M2, U, X>(x + M * K, w + n * K, K, out + M);
      for (int m = 0; m < M + M2; ++m) y[m * N + n] = typename V::T(out[m] + (b ? float(b[n]) : 0.f));
    }
  });
}

// x of the weight's type, or f32 (X = float) where V widens bf16 as it reads (V::kWidens)
template <class V, class X = typename V::T>
inline void by_count(int64_t M, const X* x, const typename V::T* w, const typename V::T* b,
              typename V::T* y, int64_t N, int64_t K) {
  switch (M) {
    case 1: return rows<V, 1, 0, X>(x, w, b, y, N, K);
    case 2: return rows<V, 2, 0, X>(x, w, b, y, N, K);
    case 3: return rows<V, 3, 0, X>(x, w, b, y, N, K);
    case 4: return rows<V, 4, 0, X>(x, w, b, y, N, K);
    case 5: return rows<V, 5, 0, X>(x, w, b, y, N, K);
    case 6: return rows<V, 6, 0, X>(x, w, b, y, N, K);
    case 7: return rows<V, 7, 0, X>(x, w, b, y, N, K);
    case 8: return rows<V, 4, 4, X>(x, w, b, y, N, K);
  }
}
#endif


}  // namespace ster_kernels
