// Fused per-row dynamic quantization for every CPU backend (cpu-bf16, cpu-fp32, cpu-fp8).
//
// Same expressions, same order as fp8ref.spec.quant.quantize: amax in fp32 (exact),
// s = max(amax, floor) / qmax in fp32 (s == 0 -> 1, then at least FLT_MIN), v = x / s as one IEEE
// fp32 division, clamp to +-qmax, one round-to-nearest-even onto the FP8 grid. The rounded value
// is written as FP8 codes (mode 0), as its exact bf16 (mode 1) or fp32 (mode 2) value. Any format
// with a mantissa of `mant` bits, smallest normal 2^emin and exponent bias `bias` (E4M3FN, E5M2,
// E4M3FNUZ); `negzero` says whether it has a -0.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "fp8ref_cpu.h"

namespace fp8ref {
namespace {

struct Fp8Params {
  int mant, emin, bias;
  bool negzero;
};

// RNE of a finite v with |v| <= the format's max onto the FP8 grid; returns the exact value.
inline float fp8_round(float v, const Fp8Params& f) {
  if (std::fabs(v) < std::ldexp(1.0f, f.emin)) {  // subnormal range: a fixed quantum 2^(emin - mant)
    const float sc = std::ldexp(1.0f, f.mant - f.emin);
    return std::nearbyint(v * sc) / sc;  // both scalings exact (powers of two); nearbyint is RNE
  }
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const int sh = 23 - f.mant;
  u += ((1u << (sh - 1)) - 1) + ((u >> sh) & 1u);  // ties to even; a carry moves into the exponent
  u &= ~((1u << sh) - 1);
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// The FP8 code of a value already on the grid.
inline uint8_t fp8_code(float r, const Fp8Params& f) {
  uint32_t u;
  std::memcpy(&u, &r, 4);
  uint32_t sign = (u >> 24) & 0x80, mag;
  const float a = std::fabs(r);
  if (a < std::ldexp(1.0f, f.emin)) mag = (uint32_t)(a * std::ldexp(1.0f, f.mant - f.emin));
  else mag = ((u >> (23 - f.mant)) & ((1u << (8 + f.mant)) - 1)) - ((uint32_t)(127 - f.bias) << f.mant);
  if (mag == 0 && !f.negzero) sign = 0;  // FNUZ formats have no -0 (0x80 is their NaN)
  return (uint8_t)(sign | mag);
}

inline void store_one(void* out, int64_t i, float r, int mode, const Fp8Params& f) {
  if (!f.negzero) r = r + 0.0f;  // -0 + 0 = +0: FNUZ has no -0
  if (mode == 0) ((uint8_t*)out)[i] = fp8_code(r, f);
  else if (mode == 1) {
    uint32_t u;
    std::memcpy(&u, &r, 4);
    ((uint16_t*)out)[i] = (uint16_t)(u >> 16);  // exact: an FP8 value has at most 4 significant bits
  } else ((float*)out)[i] = r;
}

// One row: returns amax (+inf if the row holds NaN or Inf; nothing is written then).
__attribute__((target("avx512f,avx512bw"))) float quant_row_avx512(const void* x, int64_t K, int t, float qmax,
                                                                    float floor, const Fp8Params& f, int mode,
                                                                    void* out, float* s_out) {
  __m512 m = _mm512_setzero_ps();
  const __m512i expmask = _mm512_set1_epi32(0x7F800000);
  __mmask16 bad = 0;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = load16(x, k, t);
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), expmask), expmask);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  float amax = _mm512_reduce_max_ps(m);
  for (; k < K; ++k) {
    const float v = load_one(x, k, t);
    if (!std::isfinite(v)) bad = 1;
    amax = std::max(amax, std::fabs(v));
  }
  if (bad) return INFINITY;
  float s = std::max(amax, floor) / qmax;
  if (s == 0.0f) s = 1.0f;
  s = std::max(s, FLT_MIN);
  *s_out = s;
  const __m512 sv = _mm512_set1_ps(s), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  const __m512 minnorm = _mm512_set1_ps(std::ldexp(1.0f, f.emin));
  const __m512 sc = _mm512_set1_ps(std::ldexp(1.0f, f.mant - f.emin));
  const __m512 isc = _mm512_set1_ps(std::ldexp(1.0f, f.emin - f.mant));
  const int sh = 23 - f.mant;
  const __m128i shc = _mm_cvtsi32_si128(sh);
  const __m512i half = _mm512_set1_epi32((1 << (sh - 1)) - 1), one = _mm512_set1_epi32(1);
  const __m512i clear = _mm512_set1_epi32(~((1 << sh) - 1));
  const __m512i magmask = _mm512_set1_epi32((1 << (8 + f.mant)) - 1);
  const __m512i rebias = _mm512_set1_epi32((127 - f.bias) << f.mant);
  const __m512i signbit = _mm512_set1_epi32(0x80), zero = _mm512_setzero_si512();
  for (k = 0; k + 16 <= K; k += 16) {
    __m512 v = _mm512_div_ps(load16(x, k, t), sv);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __mmask16 sub = _mm512_cmp_ps_mask(_mm512_abs_ps(v), minnorm, _CMP_LT_OQ);
    const __m512 rs = _mm512_mul_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(v, sc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), isc);
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srl_epi32(u, shc), one)));
    u = _mm512_and_si512(u, clear);
    __m512 r = _mm512_mask_blend_ps(sub, _mm512_castsi512_ps(u), rs);
    if (!f.negzero) r = _mm512_add_ps(r, _mm512_setzero_ps());  // -0 + 0 = +0: FNUZ has no -0
    if (mode == 2) {
      _mm512_storeu_ps((float*)out + k, r);
    } else if (mode == 1) {
      _mm256_storeu_si256((__m256i*)((uint16_t*)out + k),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(r), 16)));
    } else {
      const __m512i ru = _mm512_castps_si512(r);
      const __m512i nmag = _mm512_sub_epi32(_mm512_and_si512(_mm512_srl_epi32(ru, shc), magmask), rebias);
      const __m512i smag = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_abs_ps(r), sc));
      const __m512i mag = _mm512_mask_blend_epi32(sub, nmag, smag);
      __m512i sign = _mm512_and_si512(_mm512_srli_epi32(ru, 24), signbit);
      if (!f.negzero) sign = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, zero), sign, zero);
      _mm_storeu_si128((__m128i*)((uint8_t*)out + k), _mm512_cvtepi32_epi8(_mm512_or_si512(sign, mag)));
    }
  }
  for (; k < K; ++k) {
    float v = load_one(x, k, t) / s;
    v = std::min(std::max(v, -qmax), qmax);
    store_one(out, k, fp8_round(v, f), mode, f);
  }
  return amax;
}

float quant_row_scalar(const void* x, int64_t K, int t, float qmax, float floor, const Fp8Params& f, int mode,
                       void* out, float* s_out) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = load_one(x, k, t);
    if (!std::isfinite(v)) return INFINITY;
    amax = std::max(amax, std::fabs(v));
  }
  float s = std::max(amax, floor) / qmax;
  if (s == 0.0f) s = 1.0f;
  s = std::max(s, FLT_MIN);
  *s_out = s;
  for (int64_t k = 0; k < K; ++k) {
    float v = load_one(x, k, t) / s;
    v = std::min(std::max(v, -qmax), qmax);
    store_one(out, k, fp8_round(v, f), mode, f);
  }
  return amax;
}

}  // namespace

// x [M, K] fp32/bf16/fp16 contiguous -> (out [M, K]: uint8 codes, bf16 or fp32 values; scale [M, 1];
// amax [M, 1], +inf for a row holding NaN or Inf). `vector` = false forces the scalar loop (tests).
std::vector<at::Tensor> quant_rows(at::Tensor x, double qmax, double floor, int64_t mant, int64_t emin,
                                   int64_t bias, bool negzero, int64_t mode, bool vector) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D tensor");
  TORCH_CHECK(x.device().is_cpu(), "quant_rows: x must be a CPU tensor, got ", x.device());
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "x must be fp32/bf16/fp16");
  TORCH_CHECK(mode >= 0 && mode <= 2, "mode must be 0, 1 or 2");
  // The rounding shifts by 23 - mant bits and the scale divides by qmax: keep both well defined.
  TORCH_CHECK(mant >= 1 && mant <= 7, "quant_rows: an FP8 format has 1 to 7 mantissa bits, got ", mant);
  TORCH_CHECK(std::isfinite(qmax) && qmax > 0 && std::isfinite(floor) && floor >= 0,
              "quant_rows: qmax must be finite and > 0 and floor finite and >= 0, got ", qmax, " and ", floor);
  const int t = st == at::kFloat ? 0 : (st == at::kBFloat16 ? 1 : 2);
  const int64_t M = x.size(0), K = x.size(1);
  const auto odt = mode == 0 ? at::kByte : (mode == 1 ? at::kBFloat16 : at::kFloat);
  auto out = at::empty({M, K}, at::dtype(odt));
  auto scale = at::empty({M, 1}, at::dtype(at::kFloat));
  auto amax = at::empty({M, 1}, at::dtype(at::kFloat));
  const Fp8Params f{(int)mant, (int)emin, (int)bias, negzero};
  const bool avx = vector && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  const char* xp = (const char*)x.data_ptr();
  char* op = (char*)out.data_ptr();
  float* sp = scale.data_ptr<float>();
  float* ap = amax.data_ptr<float>();
  const int64_t isz = x.element_size(), osz = out.element_size();
  const float fq = (float)qmax, ff = (float)floor;
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      sp[m] = 1.0f;
      ap[m] = avx ? quant_row_avx512(xp + m * K * isz, K, t, fq, ff, f, (int)mode, op + m * K * osz, sp + m)
                  : quant_row_scalar(xp + m * K * isz, K, t, fq, ff, f, (int)mode, op + m * K * osz, sp + m);
    }
  });
  return {out, scale, amax};
}

}  // namespace fp8ref
