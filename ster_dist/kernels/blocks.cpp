// y = x W^T (+ b) over a weight kept in GGML blocks of 32 (Q8_0, Q4_0, Q4_1: parallel/ggml.py says the layouts),
// for 1 to 64 rows of x (decode steps). Built with the package's other kernels at first use (kernels/__init__.py).
//
// As llama.cpp computes its dot products: each row of x is quantized to 8 bits per block of 32 (Q8_0: an f16
// scale, rounded half away from zero, the same bits as ggml's quantize_row_q8_0), and each weight block meets
// each row's block in integers: with AVX-512 VNNI one vpdpbusd (unsigned weight bytes times signed activations)
// per block and row, the weight block unpacked once for every row of x. Weight bytes are made unsigned first: a
// Q4 nibble already is; a Q8_0 byte has 128 added (xor 0x80), taken back through the row block's sum of its
// quantized values, as is Q4_0's offset of 8 and Q4_1's minimum. Without VNNI the same sums run as scalar loops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define STER_BLOCKS_VNNI 1
#else
#define STER_BLOCKS_VNNI 0
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 64;
constexpr int64_t kRowChunk = 8;  // rows of x whose accumulators stay in registers while a weight row streams by
enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

int64_t block_bytes(int64_t kind) { return kind == kQ8_0 ? 34 : kind == kQ4_1 ? 20 : 18; }

float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if STER_BLOCKS_VNNI
  return _cvtsh_ss(bits);  // F16C, one instruction: c10::Half's portable conversion was a third of a block's work
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// x's rows quantized per block of 32: values [M][K], each block's scale (f16-rounded, as ggml stores it), the
// scale times the block's sum of quantized values (for Q4_1's minimum), and the sum times the offset the weight
// bytes carry (-128 for Q8_0, -8 for Q4_0, 0 for Q4_1) as a float, so the offset is one product per block
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum, offset_sum;
};

Activations quantize_rows(const float* x, int64_t M, int64_t K, int64_t kind) {
  const int64_t nb = K / kBlock;
  Activations a;
  a.q.resize(M * K);
  a.scale.resize(M * nb);
  a.scaled_sum.resize(M * nb);
  a.offset_sum.resize(M * nb);
  const float offset = kind == kQ8_0 ? -128.0f : kind == kQ4_0 ? -8.0f : 0.0f;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * K + b * kBlock;
      float amax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = a.q.data() + m * K + b * kBlock;
      int sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        q[i] = static_cast<int8_t>(std::round(v[i] * id));  // half away from zero, as ggml's roundf
        sum += q[i];
      }
      const float stored = static_cast<float>(c10::Half(d));
      a.scale[m * nb + b] = stored;
      a.scaled_sum[m * nb + b] = stored * sum;
      a.offset_sum[m * nb + b] = stored * sum * offset;
    }
  }
  return a;
}

// one weight block's 32 values as unsigned bytes (see the file's comment), its scale and (Q4_1) minimum
struct Unpacked {
  alignas(32) uint8_t u[kBlock];
  float d, min;
};

inline void unpack(const uint8_t* blk, int64_t kind, Unpacked& w) {
  w.d = half(blk);
  w.min = kind == kQ4_1 ? half(blk + 2) : 0.0f;
  if (kind == kQ8_0) {
    for (int64_t i = 0; i < kBlock; ++i) w.u[i] = blk[2 + i] ^ 0x80;
    return;
  }
  const uint8_t* qs = blk + (kind == kQ4_1 ? 4 : 2);
  for (int64_t i = 0; i < 16; ++i) {
    w.u[i] = qs[i] & 0x0F;
    w.u[i + 16] = qs[i] >> 4;
  }
}

#if STER_BLOCKS_VNNI
// the weight block's unsigned bytes in one 256-bit vector, unpacked in registers
inline __m256i unpack_vector(const uint8_t* blk, int64_t kind) {
  if (kind == kQ8_0)
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), _mm256_set1_epi8(-128));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (kind == kQ4_1 ? 4 : 2)));
  const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
}

inline float horizontal(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// output row n for rows [m0, m0 + count) of x, into y[m][n]
void row_chunk(const uint8_t* wrow, int64_t nb, int64_t kind, const Activations& a, int64_t K, int64_t m0,
               int64_t count, float* y, int64_t N, int64_t n) {
  const int64_t bytes = block_bytes(kind);
  float extra[kRowChunk] = {0};
#if STER_BLOCKS_VNNI
  __m256 acc[kRowChunk];
  for (int64_t r = 0; r < count; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bytes;
    const __m256i w = unpack_vector(blk, kind);
    const float d = half(blk), min = kind == kQ4_1 ? half(blk + 2) : 0.0f;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t at = (m0 + r) * nb + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + r) * K + b * kBlock));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xq);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.scale[at]), acc[r]);
      extra[r] += d * a.offset_sum[at] + min * a.scaled_sum[at];
    }
  }
  for (int64_t r = 0; r < count; ++r) y[(m0 + r) * N + n] = horizontal(acc[r]) + extra[r];
#else
  float acc[kRowChunk] = {0};
  Unpacked w;
  for (int64_t b = 0; b < nb; ++b) {
    unpack(wrow + b * bytes, kind, w);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t at = (m0 + r) * nb + b;
      const int8_t* xq = a.q.data() + (m0 + r) * K + b * kBlock;
      int dot = 0;
      for (int64_t i = 0; i < kBlock; ++i) dot += static_cast<int>(w.u[i]) * xq[i];
      acc[r] += static_cast<float>(dot) * (w.d * a.scale[at]);
      extra[r] += w.d * a.offset_sum[at] + w.min * a.scaled_sum[at];
    }
  }
  for (int64_t r = 0; r < count; ++r) y[(m0 + r) * N + n] = acc[r] + extra[r];
#endif
}

at::Tensor block_product(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t kind, int64_t K) {
  TORCH_CHECK(kind == kQ8_0 || kind == kQ4_0 || kind == kQ4_1, "block_product: GGML type ", kind,
              " is not Q8_0 (8), Q4_0 (2) or Q4_1 (3)");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "block_product: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "block_product: x f32 or bf16");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "block_product: ", K, " columns are not whole blocks of ", kBlock);
  TORCH_CHECK(x.size(-1) == K, "block_product: x has ", x.size(-1), " columns, the weight ", K);
  const int64_t nb = K / kBlock, bytes = block_bytes(kind);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == nb * bytes,
              "block_product: the weight is not contiguous uint8 [rows, ", nb * bytes, "] (", nb, " blocks of ",
              bytes, " bytes)");
  const int64_t N = weight.size(0);
  const at::Tensor rows = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = rows.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "block_product: 1 to ", kMaxRows, " rows");
  const Activations a = quantize_rows(rows.data_ptr<float>(), M, K, kind);
  at::Tensor y = at::empty({M, N}, rows.options());
  float* out = y.data_ptr<float>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  // each thread streams a contiguous share of the weight's rows once, every row of x meeting each block as it
  // passes (a share at least 16 rows, so small projections are not cut finer than a thread's start costs)
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += kRowChunk)
        row_chunk(w + n * nb * bytes, nb, kind, a, K, m0, std::min(kRowChunk, M - m0), out, N, n);
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "block_product: a bias of ", N, " elements");
    y.add_(bias->to(at::kFloat).view({1, N}));
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}

bool block_vnni() { return STER_BLOCKS_VNNI; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ster_kernels, m) {
  m.def("block_product(Tensor x, Tensor weight, Tensor? bias, int kind, int cols) -> Tensor");
  m.def("block_vnni() -> bool", &block_vnni);
}

TORCH_LIBRARY_IMPL(ster_kernels, CPU, m) { m.impl("block_product", &block_product); }
