// The cpu-fp8 GEMM without avx512_bf16: E4M3FN codes decoded to fp32 (through fp16 bit patterns,
// AVX-512 + F16C) and multiplied-added in fp32, or a scalar loop on CPUs without AVX-512.
//
// acc[m, n] = sum_k a[m, k] b[n, k] over the decoded values (each times 2^-8, so acc is the dot
// product times 2^-16). Every product of two FP8 values is exact in fp32, so each FMA rounds once,
// like an fp32 addition (Accumulation.FP32); the epilogue ((acc * 2^16) * sa) * sb (+ bias) is fp32 too.
#include <algorithm>
#include <cmath>

#include "decode.h"
#include "fp8ref_cpu.h"

namespace fp8ref {
namespace {

template <int MM>
__attribute__((target("avx512f,avx512bw,f16c"))) void rows_avx512_t(const float* ad, int64_t K, const uint8_t* b,
                                                                     int64_t n0, int64_t n1, float* acc,
                                                                     int64_t ld_acc) {
  const int64_t K16 = K - K % 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* bn = b + n * K;
    __m512 s[MM];
#pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) s[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      const __m512 bv = decode16(bn + k);
#pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) s[m] = _mm512_fmadd_ps(_mm512_loadu_ps(ad + m * K + k), bv, s[m]);
    }
    for (int m = 0; m < MM; ++m) {
      float t = _mm512_reduce_add_ps(s[m]);
      for (int64_t k = K16; k < K; ++k) t = std::fma(ad[m * K + k], decode_scalar(bn[k]), t);
      acc[m * ld_acc + (n - n0)] = t;
    }
  }
}

// Rows in chunks of 8, 4, 2, 1 so that every accumulator stays in a register (16 spilled: 4x slower).
void rows_avx512(const float* ad, int64_t M, int64_t K, const uint8_t* b, int64_t n0, int64_t n1, float* acc) {
  const int64_t ld = n1 - n0;
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) rows_avx512_t<8>(ad + m * K, K, b, n0, n1, acc + m * ld, ld);
  if (m + 4 <= M) { rows_avx512_t<4>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 4; }
  if (m + 2 <= M) { rows_avx512_t<2>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 2; }
  if (m + 1 <= M) { rows_avx512_t<1>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 1; }
}

void rows_scalar(const float* ad, int64_t M, int64_t K, const uint8_t* b, int64_t n0, int64_t n1, float* acc) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float t = 0.f;
      for (int64_t k = 0; k < K; ++k) t = std::fma(ad[m * K + k], decode_scalar(b[n * K + k]), t);
      acc[m * (n1 - n0) + (n - n0)] = t;
    }
  }
}

}  // namespace

// out[m, n] = (acc * 2^16) * sa[m] * sb[n] (+ bias[n]), fp32.
at::Tensor fp8_e4m3_gemm(at::Tensor a, at::Tensor b, at::Tensor sa, at::Tensor sb, at::Tensor bias, bool has_bias) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "fp8_e4m3_gemm: a [M, K] and b [N, K] must be 2-D, got shapes ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "fp8_e4m3_gemm: a and b must be CPU tensors");
  TORCH_CHECK(a.dtype() == at::kByte && b.dtype() == at::kByte, "codes must be uint8 views");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "codes must be contiguous");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(b.size(1) == K, "K mismatch");
  check_fp32_vector(sa, M, "fp8_e4m3_gemm", "sa");
  check_fp32_vector(sb, N, "fp8_e4m3_gemm", "sb");
  if (has_bias) check_fp32_vector(bias, N, "fp8_e4m3_gemm", "bias");
  auto out = at::empty({M, N}, at::dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  std::vector<float> ad(M * K);
  const uint8_t* ap = a.data_ptr<uint8_t>();
  for (int64_t i = 0; i < M * K; ++i) ad[i] = decode_scalar(ap[i]);
  const bool avx = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("f16c");
  const float* sap = sa.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const uint8_t* bcodes = b.data_ptr<uint8_t>();
  // 2^16 undoes the two 2^-8 of the fp16 decoding, exactly.
  const float unscale = 65536.0f;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M * (n1 - n0));
    if (avx) rows_avx512(ad.data(), M, K, bcodes, n0, n1, acc.data());
    else rows_scalar(ad.data(), M, K, bcodes, n0, n1, acc.data());
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = n0; n < n1; ++n) {
        float y = acc[m * (n1 - n0) + (n - n0)] * unscale;
        y = y * sap[m];
        y = y * sbp[n];
        if (bp) y = y + bp[n];
        op[m * N + n] = y;
      }
    }
  });
  return out;
}

}  // namespace fp8ref
