// The scale epilogue of the wide-GEMM CPU backends (cpu-bf16, cpu-fp32), fused into one pass
// (AVX-512, AVX2 + FMA + F16C or scalar, chosen at run time by cpu_isa()).
//
// out[m, n] = round((y[m, n] * sa[m]) * sb[n] (+ bias[n])), all in fp32, rounded once to bf16 (or
// kept fp32): the eager epilogue's expression order, so the result is bit-identical to it (as long
// as the compiler does not contract the multiply-add: -ffp-contract=off).
#include <algorithm>

#include "fp8ref_cpu.h"

namespace fp8ref {
namespace {

// One row: out[n] = round((y[n] * sa) * sb[n] (+ bias[n])) for n in [n0, n1).
void epi_row_scalar(const void* y, bool in_bf16, float sa, const float* sb, const float* bias, void* out,
                    bool out_bf16, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    float v = load_one(y, n, in_bf16 ? 1 : 0);
    v = v * sa;
    v = v * sb[n];
    if (bias) v = v + bias[n];
    if (out_bf16) ((uint16_t*)out)[n] = bf16_bits(v);
    else ((float*)out)[n] = v;
  }
}

__attribute__((target("avx512f,avx512bw"))) void epi_row_avx512(const void* y, bool in_bf16, float sa,
                                                                 const float* sb, const float* bias, void* out,
                                                                 bool out_bf16, int64_t n0, int64_t n1) {
  const __m512 va = _mm512_set1_ps(sa);
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    __m512 v = _mm512_mul_ps(load16(y, n, in_bf16 ? 1 : 0), va);
    v = _mm512_mul_ps(v, _mm512_loadu_ps(sb + n));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
    if (out_bf16) {
      _mm256_storeu_si256((__m256i*)((uint16_t*)out + n), bf16_bits16(v));
    } else {
      _mm512_storeu_ps((float*)out + n, v);
    }
  }
  epi_row_scalar(y, in_bf16, sa, sb, bias, out, out_bf16, n, n1);
}

// The same on 8 lanes (AVX2 + F16C).
__attribute__((target("avx2,f16c"))) void epi_row_avx2(const void* y, bool in_bf16, float sa, const float* sb,
                                                       const float* bias, void* out, bool out_bf16, int64_t n0,
                                                       int64_t n1) {
  const __m256 va = _mm256_set1_ps(sa);
  const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(0x40);
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    __m256 v = _mm256_mul_ps(load8(y, n, in_bf16 ? 1 : 0), va);
    v = _mm256_mul_ps(v, _mm256_loadu_ps(sb + n));
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
    if (out_bf16) {  // RNE to bf16 in integers (bf16_bits, 8 lanes); NaN stays NaN
      const __m256i u = _mm256_castps_si256(v);
      const __m256i hi = _mm256_srli_epi32(u, 16);
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(hi, one))), 16);
      r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      _mm_storeu_si128((__m128i*)((uint16_t*)out + n), _mm256_castsi256_si128(packed));
    } else {
      _mm256_storeu_ps((float*)out + n, v);
    }
  }
  epi_row_scalar(y, in_bf16, sa, sb, bias, out, out_bf16, n, n1);
}

}  // namespace

// y is the wide GEMM's bf16 or fp32 output; when its dtype is the output's, the result is written
// over it (the caller owns y). isa: -1 the best this CPU runs, else 0 scalar, 1 AVX2, 2 AVX-512.
at::Tensor scale_epilogue(at::Tensor y, at::Tensor sa, at::Tensor sb, at::Tensor bias, bool has_bias,
                          bool out_bf16, int64_t isa) {
  const CsrGuard csr;  // IEEE subnormals on this thread, whatever the caller set
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "y must be a contiguous 2-D tensor");
  TORCH_CHECK(y.device().is_cpu(), "scale_epilogue: y must be a CPU tensor, got ", y.device());
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16, "y must be fp32/bf16");
  const int64_t M = y.size(0), N = y.size(1);
  check_fp32_vector(sa, M, "scale_epilogue", "sa");
  check_fp32_vector(sb, N, "scale_epilogue", "sb");
  if (has_bias) check_fp32_vector(bias, N, "scale_epilogue", "bias");
  const bool in_bf16 = y.scalar_type() == at::kBFloat16;
  at::Tensor out = in_bf16 == out_bf16 ? y : at::empty({M, N}, at::dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0 || N == 0) return out;  // nothing to do (and the grain size below divides by min(N, C))
  const float* sap = sa.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const char* yp = (const char*)y.data_ptr();
  char* op = (char*)out.data_ptr();
  const int64_t ysz = y.element_size(), osz = out.element_size();
  const int64_t best = cpu_isa();
  if (isa < 0) isa = best;
  TORCH_CHECK(isa <= best, "this CPU lacks the instructions of code path ", isa);
  // Work items are (row, chunk of up to 4096 columns): rows in parallel, and long rows split too.
  const int64_t C = 4096, chunks = (N + C - 1) / C;
  at::parallel_for(0, M * chunks, std::max<int64_t>(1, 16384 / std::min(N, C)), [&](int64_t i0, int64_t i1) {
    const CsrGuard csr;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / chunks, n0 = (i % chunks) * C, n1 = std::min(N, n0 + C);
      const auto row = isa == 2 ? epi_row_avx512 : (isa == 1 ? epi_row_avx2 : epi_row_scalar);
      row(yp + m * N * ysz, in_bf16, sap[m], sbp, bp, op + m * N * osz, out_bf16, n0, n1);
    }
  });
  return out;
}

}  // namespace fp8ref
