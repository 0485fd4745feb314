// The cpu-fp8 GEMM without avx512_bf16, on the [N, K] codes as they are: E4M3FN codes decoded to
// fp32 through fp16 bit patterns and multiplied-added in fp32, with AVX-512 + F16C, AVX2 + FMA +
// F16C, or a scalar loop on other CPUs (chosen at run time).
//
// acc[m, n] = sum_k a[m, k] b[n, k] over the decoded values (each times 2^-8, so acc is the dot
// product times 2^-16). Every product of two FP8 values is exact in fp32, so each FMA rounds once,
// like an fp32 addition (Accumulation.FP32); the vector paths keep 8 or 16 partial sums per output
// (lanes along K) and add them at the end, each addition rounded once, which the same bound covers.
// Scaled by 2^-16, every non-zero product is at least 2^-34 in magnitude and every partial sum a
// multiple of it: never subnormal. The epilogue ((acc * 2^16) * sa) * sb (+ bias) is fp32 too.
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

// Rows in chunks of 8, 4, 2, 1 so that every accumulator stays in a register (16 rows spilled them,
// several times slower: docs/performance.md, "Figures behind the code").
void rows_avx512(const float* ad, int64_t M, int64_t K, const uint8_t* b, int64_t n0, int64_t n1, float* acc) {
  const int64_t ld = n1 - n0;
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) rows_avx512_t<8>(ad + m * K, K, b, n0, n1, acc + m * ld, ld);
  if (m + 4 <= M) { rows_avx512_t<4>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 4; }
  if (m + 2 <= M) { rows_avx512_t<2>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 2; }
  if (m + 1 <= M) { rows_avx512_t<1>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 1; }
}

// 16 codes -> their values times 2^-8 (two vectors of 8), through the fp16 bit pattern
// ((c & 0x7F) << 7 | sign << 15): the sign-extended code shifted left by 7 has the sign in bit 15
// and a copy of it in bit 14, which the mask clears.
__attribute__((target("avx2,fma,f16c"))) static inline void decode16_avx2(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16((short)0xBF80));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MB rows x NB columns over K in [k0, k1) (multiples of 16): MB * NB accumulators of 8 lanes along
// K, read from and left in vacc ([row][column][8], ldv floats per row). Each weight vector is
// decoded once for the MB rows and each activation vector loaded once for the NB columns
// (accumulators, weights and the two activation vectors fit the 16 ymm registers).
template <int MB, int NB>
__attribute__((target("avx2,fma,f16c"))) void block_avx2(const float* ad, int64_t lda, const uint8_t* b, int64_t K,
                                                          int64_t k0, int64_t k1, float* vacc, int64_t ldv) {
  __m256 s[MB][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) s[m][j] = _mm256_loadu_ps(vacc + m * ldv + j * 8);
  for (int64_t k = k0; k < k1; k += 16) {
    __m256 w[NB][2];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) decode16_avx2(b + j * K + k, w[j][0], w[j][1]);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 a0 = _mm256_loadu_ps(ad + m * lda + k), a1 = _mm256_loadu_ps(ad + m * lda + k + 8);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        s[m][j] = _mm256_fmadd_ps(a0, w[j][0], s[m][j]);
        s[m][j] = _mm256_fmadd_ps(a1, w[j][1], s[m][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) _mm256_storeu_ps(vacc + m * ldv + j * 8, s[m][j]);
}

template <int MB, int NB>
__attribute__((target("avx2,fma,f16c"))) void cols_avx2(const float* ad, int64_t lda, const uint8_t* b, int64_t K,
                                                         int64_t k0, int64_t k1, int64_t ncols, float* vacc,
                                                         int64_t ldv) {
  int64_t j = 0;
  for (; j + NB <= ncols; j += NB) block_avx2<MB, NB>(ad, lda, b + j * K, K, k0, k1, vacc + j * 8, ldv);
  for (; j < ncols; ++j) block_avx2<MB, 1>(ad, lda, b + j * K, K, k0, k1, vacc + j * 8, ldv);
}

// ad is [M, lda] with lda = avx2_lda(K): rows 64 bytes apart modulo 4 KiB, so that the rows of a
// block do not all map to one L1 set.
int64_t avx2_lda(int64_t K) { return (K + 15) / 16 * 16 + 16; }

// Columns per slice. Each register block runs over the whole of K, so every weight row is read
// as one sequential stream. K chunks of 256 (the slice's codes kept in L1 across row blocks) had
// gained with the weight in cache on one AVX2 CPU, but on another they were slower with the
// weights from memory (the weight then streamed in 256-byte pieces of 16 rows at a time) and
// gained nothing in cache (docs/performance.md, "Figures behind the code").
constexpr int64_t kSliceCols = 16;

__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const float* ad, int64_t M, int64_t K, const uint8_t* b,
                                                         int64_t n0, int64_t n1, float* acc) {
  const int64_t ld = n1 - n0, lda = avx2_lda(K), K16 = K - K % 16, ldv = kSliceCols * 8;
  std::vector<float> vacc(M * ldv);
  for (int64_t c0 = n0; c0 < n1; c0 += kSliceCols) {
    const int64_t nc = std::min(n1, c0 + kSliceCols) - c0;
    const uint8_t* bs = b + c0 * K;
    std::fill(vacc.begin(), vacc.end(), 0.0f);
    int64_t r = 0;  // the row blocks: 4, then 2, then 1 rows
    for (; r + 4 <= M; r += 4) cols_avx2<4, 2>(ad + r * lda, lda, bs, K, 0, K16, nc, &vacc[r * ldv], ldv);
    if (r + 2 <= M) { cols_avx2<2, 2>(ad + r * lda, lda, bs, K, 0, K16, nc, &vacc[r * ldv], ldv); r += 2; }
    if (r + 1 <= M) cols_avx2<1, 4>(ad + r * lda, lda, bs, K, 0, K16, nc, &vacc[r * ldv], ldv);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < nc; ++j) {
        float t = hsum8(_mm256_loadu_ps(&vacc[m * ldv + j * 8]));
        for (int64_t k = K16; k < K; ++k) t = std::fma(ad[m * lda + k], decode_scalar(bs[j * K + k]), t);
        acc[m * ld + (c0 - n0) + j] = t;
      }
  }
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

int64_t gemm_isa() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
  return 0;
}

// out[m, n] = (acc * 2^16) * sa[m] * sb[n] (+ bias[n]), fp32. isa: -1 the best this CPU runs
// (gemm_isa), else 0 scalar, 1 AVX2, 2 AVX-512 (tests force each one).
at::Tensor fp8_e4m3_gemm(at::Tensor a, at::Tensor b, at::Tensor sa, at::Tensor sb, at::Tensor bias, bool has_bias,
                         int64_t isa) {
  const CsrGuard csr;  // IEEE subnormals on this thread, whatever the caller set
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "fp8_e4m3_gemm: a [M, K] and b [N, K] must be 2-D, got shapes ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "fp8_e4m3_gemm: a and b must be CPU tensors");
  TORCH_CHECK(a.dtype() == at::kByte && b.dtype() == at::kByte, "codes must be uint8 views");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous(),
              "fp8_e4m3_gemm: codes a [M, K] and b [N, K] must be contiguous 2-D, got shapes ", a.sizes(), " and ",
              b.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(b.size(1) == K, "K mismatch");
  check_fp32_vector(sa, M, "fp8_e4m3_gemm", "sa");
  check_fp32_vector(sb, N, "fp8_e4m3_gemm", "sb");
  if (has_bias) check_fp32_vector(bias, N, "fp8_e4m3_gemm", "bias");
  const int64_t best = gemm_isa();
  if (isa < 0) isa = best;
  TORCH_CHECK(isa <= best, "this CPU lacks the instructions of code path ", isa);
  auto out = at::empty({M, N}, at::dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  const int64_t lda = isa == 1 ? avx2_lda(K) : K;
  std::vector<float> ad(M * lda);
  const uint8_t* ap = a.data_ptr<uint8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) ad[m * lda + k] = decode_scalar(ap[m * K + k]);
  const float* sap = sa.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const uint8_t* bcodes = b.data_ptr<uint8_t>();
  // 2^16 undoes the two 2^-8 of the fp16 decoding, exactly.
  const float unscale = 65536.0f;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    const CsrGuard csr;
    std::vector<float> acc(M * (n1 - n0));
    if (isa == 2) rows_avx512(ad.data(), M, K, bcodes, n0, n1, acc.data());
    else if (isa == 1) rows_avx2(ad.data(), M, K, bcodes, n0, n1, acc.data());
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
