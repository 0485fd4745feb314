// The cpu-fp8 GEMM with avx512_bf16 (vdpbf16ps) on a weight packed once, at prepare_weight time.
//
// The weight codes are re-laid out as [N/16][K/2][16][2] (zero-padded to N % 16 == 0 and
// K % 2 == 0; fp8ref.kernels.cpu_fp8.pack_weight), so that 32 consecutive codes decode to one
// vdpbf16ps operand holding 16 output columns x 2 K-steps. Each activation row contributes a
// broadcast (a[m, 2p], a[m, 2p + 1]) pair, and up to 16 rows share each decoded vector: every
// weight code is decoded once per 16 rows, and the 16 accumulators are output columns (no
// horizontal sums). Each lane accumulates its column's products two per instruction, one fp32
// rounding per addition, into CH chains per row (K-step p into chain p % CH, the chains added at
// the end: still K - 1 additions per output at most, so the fp32-accumulation bound holds);
// products of FP8 values are exact in fp32.
//
// Scaled operands. A 32-code group with no zero or subnormal code (pack_weight's `special` is 0)
// decodes in three instructions (decode32_scaled: sign-extend, shift, mask) to bf16 values that are
// the weight's times 2^-120 (E4M3's exponent field read with bf16's bias), multiplied by activation
// pairs scaled by 2^64 (ahi); other groups decode to the exact values (decode32_bf16's table)
// and take pairs scaled by 2^-56 (alo). Every product is then the exact product times 2^-56,
// and so is every partial sum: scaling by a power of two commutes with fp32 rounding while nothing
// leaves the normal range, and nothing does (products are multiples of 2^-18 below 2^18, so scaled
// partial sums are multiples of 2^-74 and never subnormal, and the instruction's DAZ/FTZ never
// acts; the largest scaled pair is 448 * 2^64). The epilogue multiplies the sum by 2^56 (exact)
// before the scales: the same bits as unscaled operands. The decode had cost six instructions per
// 32 codes, which bounded the M = 1 rows (docs/performance.md, "Figures behind the code").
#include <cpuid.h>

#include <algorithm>

#include "decode.h"
#include "fp8ref_cpu.h"

namespace fp8ref {
namespace {

// acc += b . broadcast(*a): vdpbf16ps with an embedded {1to16} memory broadcast. Written in asm
// because GCC emits a separate vpbroadcastd, which competes with vdpbf16ps for the vector pipes
// (about twice the cycles per dot product: docs/performance.md, "Figures behind the code").
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void dpbf16_bcast(__m512& acc, __m512bh b,
                                                                                 const uint32_t* a) {
  asm("vdpbf16ps %[a]%{1to16%}, %[b], %[acc]" : [acc] "+v"(acc) : [b] "v"(b), [a] "m"(*a));
}

// Bytes of packed weight prefetched ahead of the K-step being decoded (each K-step reads 32), one
// prefetch per 64-byte line (per K-step where a block keeps one chain: its 16 rows are slow enough).
// With the weights streamed from DRAM, the hardware prefetcher alone left M = 8..16 rows waiting on
// memory, and the M = 1..4 rows, whose decode is cheap, needed the prefetch further ahead: 8192
// bytes streamed as fast as an int64 sum of the same bytes, longer distances were no better, and
// M = 16 ran the same at every distance (docs/performance.md, "Figures behind the code").
constexpr int64_t kPrefetch = 8192;

// Whether the blocks of at most 4 rows prefetch into L2 (prefetcht1) instead of L1 (prefetcht0):
// on AMD family 25 (the family's CPUs that have avx512_bf16 and so run this file). There, with the
// weights streamed from DRAM, T1 made M = 1..4 faster and M = 16 no faster (so the 8- and 16-row
// blocks keep T0), and changed nothing in L3. Elsewhere T0 stays: on AMD family 26 it already
// streamed as fast as an int64 sum of the same bytes, and no other CPU has measured T1
// (docs/performance.md, "Figures behind the code").
bool prefetch_to_l2() {
  static const bool zen4 = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xFu, family = base == 0xFu ? base + ((eax >> 20) & 0xFFu) : base;
    return family == 0x19u;
  }();
  return zen4;
}

// The scales of the two pair arrays (bf16 exponent steps) and what undoes them (header comment).
constexpr int kHiShift = 64, kLoShift = -56;
constexpr float kUnscale = 0x1p56f;

// 32 codes of a group with no zero or subnormal code -> bf16 bits of their values times 2^-120:
// sign-extended, (c << 4) puts the mantissa at bits 4-6, the exponent field at 7-10 and the sign
// at 11-15; `mask` (kScaledMask, held in a register by the caller: scaled_mask()) keeps bits 4-10
// and 15.
constexpr short kScaledMask = (short)0x87F0;
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512i decode32_scaled(const uint8_t* p,
                                                                                      __m512i mask) {
  const __m512i c = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_and_si512(_mm512_slli_epi16(c, 4), mask);
}
// kScaledMask in every 16-bit lane, opaque to the optimizer: with the constant visible, GCC 12
// rematerialized it before every K-step's and (mov + vpbroadcastd from a general register, one
// more vector op in five on the M = 1 rows' critical resource; seen in the disassembly).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512i scaled_mask() {
  __m512i m = _mm512_set1_epi16(kScaledMask);
  asm("" : "+v"(m));
  return m;
}
template <int MM, int CH, int HINT = _MM_HINT_T0>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void packed_block(const uint32_t* ahi, const uint32_t* alo,
                                                                          int64_t lda, int64_t K2, const uint8_t* pb,
                                                                          const uint8_t* special, float* out,
                                                                          int64_t ldo) {
  // CH independent accumulator chains per row, K-step p feeding chain p % CH: vdpbf16ps has a
  // latency of several cycles, so one chain per row leaves a few rows waiting on it.
  __m512 s[CH][MM];
  const __m512i mask = scaled_mask();
#pragma GCC unroll 16
  for (int c = 0; c < CH; ++c)
#pragma GCC unroll 16
    for (int i = 0; i < MM; ++i) s[c][i] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + CH <= K2; p += CH) {
#pragma GCC unroll 8
    for (int c = 0; c < CH; c += 2) _mm_prefetch((const char*)(pb + (p + c) * 32 + kPrefetch), (_mm_hint)HINT);
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) {
      const int64_t q = p + c;
      const bool sp = special[q];
      const __m512bh bv = (__m512bh)(sp ? decode32_bf16(pb + q * 32) : decode32_scaled(pb + q * 32, mask));
      const uint32_t* ap = (sp ? alo : ahi) + q * lda;
#pragma GCC unroll 16
      for (int i = 0; i < MM; ++i) dpbf16_bcast(s[c][i], bv, ap + i);
    }
  }
  for (; p < K2; ++p) {
    const bool sp = special[p];
    const __m512bh bv = (__m512bh)(sp ? decode32_bf16(pb + p * 32) : decode32_scaled(pb + p * 32, mask));
    const uint32_t* ap = (sp ? alo : ahi) + p * lda;
#pragma GCC unroll 16
    for (int i = 0; i < MM; ++i) dpbf16_bcast(s[0][i], bv, ap + i);
  }
#pragma GCC unroll 8
  for (int c = 1; c < CH; ++c)
#pragma GCC unroll 16
    for (int i = 0; i < MM; ++i) s[0][i] = _mm512_add_ps(s[0][i], s[c][i]);
#pragma GCC unroll 16
  for (int i = 0; i < MM; ++i) _mm512_storeu_ps(out + i * ldo, s[0][i]);
}

// ahi, alo are [K2][M] (p-major): the rows' pairs for one K-step share a cache line.
void packed_rows(const uint32_t* ahi, const uint32_t* alo, int64_t M, int64_t K2, const uint8_t* pb,
                 const uint8_t* sp, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 16 <= M; m += 16) packed_block<16, 1>(ahi + m, alo + m, M, K2, pb, sp, out + m * ldo, ldo);
  for (; m + 8 <= M; m += 8) packed_block<8, 2>(ahi + m, alo + m, M, K2, pb, sp, out + m * ldo, ldo);
  const uint32_t *hp = ahi + m, *lp = alo + m;
  float* op = out + m * ldo;
  const bool l2 = prefetch_to_l2();
  switch (M - m) {
    case 0: break;
    case 1: (l2 ? packed_block<1, 8, _MM_HINT_T1> : packed_block<1, 8>)(hp, lp, M, K2, pb, sp, op, ldo); break;
    case 2: (l2 ? packed_block<2, 4, _MM_HINT_T1> : packed_block<2, 4>)(hp, lp, M, K2, pb, sp, op, ldo); break;
    case 3: (l2 ? packed_block<3, 4, _MM_HINT_T1> : packed_block<3, 4>)(hp, lp, M, K2, pb, sp, op, ldo); break;
    case 4: (l2 ? packed_block<4, 4, _MM_HINT_T1> : packed_block<4, 4>)(hp, lp, M, K2, pb, sp, op, ldo); break;
    case 5: packed_block<5, 2>(hp, lp, M, K2, pb, sp, op, ldo); break;
    case 6: packed_block<6, 2>(hp, lp, M, K2, pb, sp, op, ldo); break;
    default: packed_block<7, 2>(hp, lp, M, K2, pb, sp, op, ldo); break;
  }
}

// The first index past the 64-code blocks of p[0, n) when none holds a NaN code, else -1.
__attribute__((target("avx512f,avx512bw"))) int64_t nan_scan_avx512(const uint8_t* p, int64_t n) {
  const __m512i low7 = _mm512_set1_epi8(0x7F);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    if (_mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(p + i), low7), low7)) return -1;
  return i;
}

// bf16 bits times 2^shift (the exponent field moved by shift; zeros stay zeros).
inline uint32_t bf16_scaled(uint32_t b, int shift) { return (b & 0x7FFF) ? b + (uint32_t)(shift * 128) : b; }

// ahi[p * M + m] = (bf16(a[m, 2p + 1]) << 16) | bf16(a[m, 2p]), both values times 2^kHiShift, with
// a[m, K] = 0 when K is odd, and alo the same times 2^kLoShift (header comment): 32 codes of a row
// decoded at once (decode32_bf16: 16 pairs), scaled, and scattered to their K-steps. The scalar
// loop this replaced was a visible share of a decode-sized call (docs/performance.md, "Figures
// behind the code").
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void build_pairs(const uint8_t* a, int64_t M, int64_t K,
                                                                         uint32_t* ahi, uint32_t* alo) {
  const int64_t K2 = (K + 1) / 2, K32 = K - K % 32;
  const __m512i step = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)M));
  const __m512i mag = _mm512_set1_epi16(0x7FFF);
  const __m512i hi_step = _mm512_set1_epi16((short)(kHiShift * 128));
  const __m512i lo_step = _mm512_set1_epi16((short)(kLoShift * 128));
  for (int64_t m = 0; m < M; ++m) {
    const uint8_t* row = a + m * K;
    for (int64_t k = 0; k < K32; k += 32) {
      const __m512i b = decode32_bf16(row + k);
      const __mmask32 nz = _mm512_test_epi16_mask(b, mag);
      _mm512_i32scatter_epi32(ahi + (k / 2) * M + m, step, _mm512_mask_add_epi16(b, nz, b, hi_step), 4);
      _mm512_i32scatter_epi32(alo + (k / 2) * M + m, step, _mm512_mask_add_epi16(b, nz, b, lo_step), 4);
    }
    for (int64_t p = K32 / 2; p < K2; ++p) {
      const uint32_t lo = bf16_of_code(row[2 * p]), hi = 2 * p + 1 < K ? bf16_of_code(row[2 * p + 1]) : 0u;
      ahi[p * M + m] = (bf16_scaled(hi, kHiShift) << 16) | bf16_scaled(lo, kHiShift);
      alo[p * M + m] = (bf16_scaled(hi, kLoShift) << 16) | bf16_scaled(lo, kLoShift);
    }
  }
}

}  // namespace

// Whether E4M3FN codes hold a NaN (0x7F or 0xFF): 64 codes per compare where AVX-512 BW runs.
bool has_nan_e4m3(at::Tensor codes) {
  TORCH_CHECK(codes.device().is_cpu() && codes.dtype() == at::kByte && codes.is_contiguous(),
              "has_nan_e4m3: codes must be a contiguous uint8 CPU tensor, got ", codes.scalar_type(), " on ",
              codes.device(), codes.is_contiguous() ? "" : " (not contiguous)");
  const uint8_t* p = codes.data_ptr<uint8_t>();
  const int64_t n = codes.numel();
  int64_t i = 0;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) i = nan_scan_avx512(p, n);
  if (i < 0) return true;
  for (; i < n; ++i)
    if ((p[i] & 0x7F) == 0x7F) return true;
  return false;
}

bool has_bf16_dot() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// a: [M, K] codes; pb: packed weight [N16, K2, 16, 2] codes; out[m, n] = (acc * sa[m]) * sb[n] (+ bias[n]), fp32.
at::Tensor fp8_e4m3_gemm_packed(at::Tensor a, at::Tensor pb, at::Tensor special, int64_t N, at::Tensor sa,
                                at::Tensor sb, at::Tensor bias, bool has_bias) {
  const CsrGuard csr;  // IEEE subnormals on this thread, whatever the caller set
  TORCH_CHECK(has_bf16_dot(), "the packed cpu-fp8 path needs avx512_bf16");
  TORCH_CHECK(a.dim() == 2 && N >= 0, "fp8_e4m3_gemm_packed: a must be 2-D [M, K] and N >= 0, got a ", a.sizes(),
              ", N = ", N);
  TORCH_CHECK(a.device().is_cpu() && pb.device().is_cpu() && special.device().is_cpu(),
              "fp8_e4m3_gemm_packed: a, pb and special must be CPU tensors");
  TORCH_CHECK(a.dtype() == at::kByte && pb.dtype() == at::kByte, "codes must be uint8 views");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && pb.is_contiguous() && pb.dim() == 4,
              "contiguous a, packed [N16, K2, 16, 2] b");
  const int64_t M = a.size(0), K = a.size(1), N16 = pb.size(0), K2 = pb.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && N16 == (N + 15) / 16 && pb.size(2) == 16 && pb.size(3) == 2, "packed shape");
  TORCH_CHECK(special.dtype() == at::kByte && special.is_contiguous() && special.numel() == N16 * K2,
              "special must be uint8 [N16, K2]");
  check_fp32_vector(sa, M, "fp8_e4m3_gemm_packed", "sa");
  check_fp32_vector(sb, N, "fp8_e4m3_gemm_packed", "sb");
  if (has_bias) check_fp32_vector(bias, N, "fp8_e4m3_gemm_packed", "bias");
  const uint8_t* spp = special.data_ptr<uint8_t>();
  auto out = at::empty({M, N}, at::dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  // [p][m]: (a[m, 2p], a[m, 2p + 1]) as bf16 bits, zero-padded, scaled by 2^64 and by 2^-56
  std::vector<uint32_t> ahi(K2 * M), alo(K2 * M);
  build_pairs(a.data_ptr<uint8_t>(), M, K, ahi.data(), alo.data());
  const float* sap = sa.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const uint8_t* pbp = pb.data_ptr<uint8_t>();
  at::parallel_for(0, N16, 4, [&](int64_t b0, int64_t b1) {
    const CsrGuard csr;
    std::vector<float> acc(M * 16);
    for (int64_t nb = b0; nb < b1; ++nb) {
      packed_rows(ahi.data(), alo.data(), M, K2, pbp + nb * K2 * 32, spp + nb * K2, acc.data(), 16);
      const int64_t n0 = nb * 16, n1 = std::min(N, n0 + 16);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) {
          float y = (acc[m * 16 + (n - n0)] * kUnscale) * sap[m];  // the sum unscaled exactly, then sa
          y = y * sbp[n];
          if (bp) y = y + bp[n];
          op[m * N + n] = y;
        }
    }
  });
  return out;
}

}  // namespace fp8ref
