// Fused dynamic quantization for every CPU backend: per-tensor, per-row, per-group (1 x G) and
// per-block (R x C) scales, in one pass over each block (two over the tensor for per-tensor).
//
// Same expressions, same order as fp8ref.spec.quant.quantize: amax in fp32 (exact),
// s = max(amax, floor) / qmax in fp32 (s == 0 -> 1; rounded up to a power of two when pow2; then
// at least FLT_MIN), v = x / s as one IEEE fp32 division, clamp to +-qmax, one round-to-nearest-even
// onto the FP8 grid. The rounded value is written as FP8 codes (mode 0), as its exact bf16 (mode 1)
// or fp32 (mode 2) value. Any format with a mantissa of `mant` bits, smallest normal 2^emin and
// exponent bias `bias` (E4M3FN, E5M2, E4M3FNUZ); `negzero` says whether it has a -0.
//
// Three code paths with the same arithmetic, chosen at run time (never from the build machine):
// AVX-512 (16 lanes), AVX2 + FMA + F16C (8 lanes), scalar. Vector bodies end in the scalar loop for the
// tail of each row segment, so every path computes every element by the same expressions.
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

// Rounding onto the FP8 grid by one addition (both vector bodies): for 0 <= a <= qmax let C be the
// power of two 2^(e + 23 - mant), e = the exponent of a (C = 2^(emin + 23 - mant) in the subnormal
// range: the larger of the two). ulp(C) is then the FP8 quantum at a's magnitude and a < C, so the
// fp32 sum a + C, rounded to nearest even, is C + a rounded to a multiple of that quantum with ties
// to even (C's significand is 1, so the parity of the sum's last bit is that of the multiple); t - C
// is exact (Sterbenz). The FP8 magnitude code is the number of quanta above C, bits(t) - bits(C),
// plus the exponent step (e - emin) << mant read off C's exponent field. Same results as fp8_round
// and fp8_code above (tests/test_native.py checks every bf16/fp16 pattern on every code path).
struct MagicRound {
  int32_t cadd, csub, kcode;
};

inline MagicRound magic_round(const Fp8Params& f) {
  const int sh = 23 - f.mant;
  const float cs = std::ldexp(1.0f, f.emin + sh);
  int32_t cb;
  std::memcpy(&cb, &cs, 4);
  return MagicRound{sh << 23, cb, cb >> sh};
}

// What one call quantizes with: the format, the clamp value, and the rounding constants made from
// the format once per call. magic_round calls ldexp (a libm call the compiler cannot hoist); made
// per 128-element group it had cost nearly half the time of 1 x 128 group scales
// (docs/performance.md, "Figures behind the code").
struct Job {
  Fp8Params f;
  float qmax;
  MagicRound mr;
  bool qmax_on_grid;  // qmax is an FP8 value: quant_bf16_avx2 may skip its clamp
};

// ---- amax of a row segment x[0, n) (max |x|), and whether it holds NaN or +-Inf ----
// On the bit patterns: for finite values |x| orders like (bits & ~sign) as an unsigned integer,
// so bf16/fp16 inputs take 16 lanes per AVX2 op; the maximum pattern is widened once at the end.

void amax_scalar(const void* x, int64_t i0, int64_t n, int t, float& amax, bool& bad) {
  for (int64_t k = i0; k < n; ++k) {
    const float v = load_one(x, k, t);
    if (!std::isfinite(v)) bad = true;
    amax = std::max(amax, std::fabs(v));
  }
}

template <int T>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void amax_avx512(const void* x, int64_t n, float& amax, bool& bad) {
  int64_t k = 0;
  if (T == 0) {
    __m512 m = _mm512_setzero_ps();
    const __m512i expmask = _mm512_set1_epi32(0x7F800000);
    __mmask16 b = 0;
    for (; k + 16 <= n; k += 16) {
      const __m512 v = _mm512_loadu_ps((const float*)x + k);
      b |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), expmask), expmask);
      m = _mm512_max_ps(m, _mm512_abs_ps(v));
    }
    amax = std::max(amax, _mm512_reduce_max_ps(m));
    if (b) bad = true;
  } else {  // 32 bf16/fp16 patterns per op, as in amax_avx2; NaN and Inf patterns order above every finite one
    const __m512i magmask = _mm512_set1_epi16(0x7FFF);
    __m512i m = _mm512_setzero_si512();
    for (; k + 32 <= n; k += 32)
      m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512((const uint16_t*)x + k), magmask));
    __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64(m, 1));
    __m128i q = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    // the largest of 8 uint16: the smallest of their complements (phminposuw)
    const uint16_t top = (uint16_t)~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi32(-1))));
    const float f = load_one(&top, 0, T);
    if (!std::isfinite(f)) bad = true;
    else amax = std::max(amax, f);
  }
  amax_scalar(x, k, n, T, amax, bad);
}

template <int T>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void amax_avx2(const void* x, int64_t n, float& amax, bool& bad) {
  int64_t k = 0;
  if (T == 0) {
    const __m256i magmask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    __m256i m = _mm256_setzero_si256();
    for (; k + 8 <= n; k += 8)
      m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)((const float*)x + k)), magmask));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256((__m256i*)lanes, m);
    int32_t top = 0;
    for (int32_t l : lanes) top = std::max(top, l);
    if (top >= 0x7F800000) bad = true;
    float f;
    std::memcpy(&f, &top, 4);
    if (!bad) amax = std::max(amax, f);
  } else {
    const __m256i magmask = _mm256_set1_epi16(0x7FFF);
    __m256i m = _mm256_setzero_si256();
    for (; k + 16 <= n; k += 16)
      m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)((const uint16_t*)x + k)), magmask));
    // the largest of 16 uint16 (as amax_avx512): the smallest of their complements (phminposuw)
    const __m128i q = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    const uint16_t top = (uint16_t)~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi32(-1))));
    const float f = load_one(&top, 0, T);
    if (!std::isfinite(f)) bad = true;
    else amax = std::max(amax, f);
  }
  amax_scalar(x, k, n, T, amax, bad);
}

// ---- quantization of a row segment x[0, n) with scale s into out[0, n) ----

void quant_scalar(const void* x, int64_t i0, int64_t n, int t, float s, const Job& j, int mode, void* out) {
  for (int64_t k = i0; k < n; ++k) {
    float v = load_one(x, k, t) / s;
    v = std::min(std::max(v, -j.qmax), j.qmax);
    store_one(out, k, fp8_round(v, j.f), mode, j.f);
  }
}

// The constants of the AVX-512 body, made once per segment.
struct Avx512Consts {
  __m512 sv;
  __m512i signbit, absbits, expmask, cadd, csub, kcode, fsign, qmaxbits;
  int shift;  // 23 - mant
};

__attribute__((target("avx512f,avx512bw"), always_inline)) inline Avx512Consts avx512_consts(float s, const Job& j) {
  int32_t qbits;
  std::memcpy(&qbits, &j.qmax, 4);
  return Avx512Consts{_mm512_set1_ps(s),          _mm512_set1_epi32(0x80),       _mm512_set1_epi32(0x7FFFFFFF),
                      _mm512_set1_epi32(0x7F800000), _mm512_set1_epi32(j.mr.cadd), _mm512_set1_epi32(j.mr.csub),
                      _mm512_set1_epi32(j.mr.kcode), _mm512_set1_epi32((int)0x80000000u), _mm512_set1_epi32(qbits),
                      23 - j.f.mant};
}

// 16 elements: |v| (v = x / s) clamped to qmax and rounded onto the grid (t and C: MagicRound), and
// v's bits (its sign). The clamp is an integer min on the magnitude's bits: non-negative floats
// (+inf too) order like their bit patterns, and v is never NaN here (quant_blocks makes each
// block's scale from its amax and skips blocks holding NaN or Inf).
template <int T>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i round16(const void* x, int64_t at,
                                                                                   const Avx512Consts& c, __m512i& vb,
                                                                                   __m512i& C) {
  vb = _mm512_castps_si512(_mm512_div_ps(load16(x, at, T), c.sv));
  const __m512i ab = _mm512_min_epu32(_mm512_and_si512(vb, c.absbits), c.qmaxbits);
  C = _mm512_max_epi32(_mm512_add_epi32(_mm512_and_si512(ab, c.expmask), c.cadd), c.csub);
  return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(ab), _mm512_castsi512_ps(C)));
}

// The FP8 codes of 16 elements as int32 lanes: sign | magnitude code (FNUZ: no -0).
template <int T, bool NZ>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i code16(const void* x, int64_t at,
                                                                                  const Avx512Consts& c) {
  __m512i vb, C;
  const __m512i t = round16<T>(x, at, c, vb, C);
  const __m512i step = _mm512_sub_epi32(_mm512_srl_epi32(C, _mm_cvtsi32_si128(c.shift)), c.kcode);
  const __m512i mag = _mm512_add_epi32(_mm512_sub_epi32(t, C), step);
  if (NZ) return _mm512_ternarylogic_epi32(mag, _mm512_srli_epi32(vb, 24), c.signbit, 0xF8);  // mag | (vb >> 24 & 0x80)
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(vb, 24), c.signbit);
  return _mm512_or_si512(_mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, _mm512_setzero_si512()), sign,
                                                 _mm512_setzero_si512()), mag);
}

template <int T, int MODE, bool NZ>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void quant_avx512(const void* x, int64_t n, float s, const Job& j,
                                                               void* out) {
  const Avx512Consts c = avx512_consts(s, j);
  int64_t k = 0;
  if (MODE == 0) {
    // 64 codes per store: two rounds of saturating packs (within 128-bit lanes) and one dword
    // permutation back into element order, instead of four vpmovdb narrowings and stores.
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; k + 64 <= n; k += 64) {
      const __m512i p01 = _mm512_packus_epi32(code16<T, NZ>(x, k, c), code16<T, NZ>(x, k + 16, c));
      const __m512i p23 = _mm512_packus_epi32(code16<T, NZ>(x, k + 32, c), code16<T, NZ>(x, k + 48, c));
      _mm512_storeu_si512((uint8_t*)out + k, _mm512_permutexvar_epi32(order, _mm512_packus_epi16(p01, p23)));
    }
    for (; k + 16 <= n; k += 16)
      _mm_storeu_si128((__m128i*)((uint8_t*)out + k), _mm512_cvtepi32_epi8(code16<T, NZ>(x, k, c)));
  } else {
    for (; k + 16 <= n; k += 16) {
      __m512i vb, C;
      const __m512i t = round16<T>(x, k, c, vb, C);
      __m512 r = _mm512_sub_ps(_mm512_castsi512_ps(t), _mm512_castsi512_ps(C));  // exact
      r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(vb, c.fsign)));
      if (!NZ) r = _mm512_add_ps(r, _mm512_setzero_ps());  // -0 + 0 = +0: FNUZ has no -0
      if (MODE == 2) _mm512_storeu_ps((float*)out + k, r);
      else
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + k),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(r), 16)));
    }
  }
  quant_scalar(x, k, n, T, s, j, MODE, out);
}

// ---- bf16 to FP8 codes on AVX2 (mode 0, the case every CPU backend's quantize runs) ----
// The arithmetic of quant8_avx2 below in fewer instructions (46 per 32 elements, 84 before; on the
// AVX2 CPU measured the loop is bound by its instruction count: docs/performance.md):
// - The split. A 32-bit lane of 16 loaded bf16 holds two elements, the even one in its low half:
//   |even| is the lane's magnitude bits shifted left by 16, |odd| the lane with its low half
//   cleared, both exact fp32 (no unpacking shuffles). Dividing magnitudes makes v = |x| / s >= 0.
// - The code. The FP8 code of a value r >= 0 on the grid is bits(r * 2^(bias - 127)) >> (23 - mant):
//   for a normal r that product's exponent field is r's FP8 exponent field and its top mant
//   mantissa bits are r's; a subnormal r = m 2^(emin - mant) (emin = 1 - bias) becomes the fp32
//   subnormal m 2^(23 - mant) 2^-149, whose bits are m << (23 - mant). The magic addition of
//   MagicRound is done in that scaled domain, t' = fma(v, K, C K) with K = 2^(bias - 127):
//   (v + C) K is rounded once, and as C K >= 2^(emin + 23 - mant + bias - 127) is a normal fp32
//   that rounding is RN(v + C) K exactly (a power-of-two scaling commutes with rounding to
//   nearest in the normal range). C K comes from v's exponent bits by the same three integer
//   operations as C (cadd and csub shifted by the scaling's exponent step), and t' - C K = r K
//   exactly (Sterbenz). No subnormal is flushed: quant_blocks clears MXCSR's FTZ and DAZ bits.
// - The narrowing. The even code (bits 23 - mant up) is shifted down by 16, the odd one stays in
//   the lane's high half; one 16-bit shift by 7 - mant leaves each element's code in its own
//   16-bit lane, in element order, and one pack makes bytes. The signs come from the input: a
//   signed-saturating pack of the bf16 patterns to bytes keeps each element's sign bit in bit 7,
//   in the same order as the codes.
// - The clamp to qmax is skipped when qmax is on the FP8 grid (qmax_on_grid): v = fl(|x| / s) with
//   |x| <= amax and s >= fl(max(amax, floor) / qmax) exceeds qmax by at most a few fp32 ulps,
//   which round to qmax, as the clamped value does (the midpoint above qmax is half an FP8
//   quantum, more than 2^-(mant + 2) qmax, away). With the clamp the loop is 50 instructions.
struct Bf16Consts {
  __m256 sv, kv;
  __m256i qmaxbits, expmask, cadd, csub, absmask, himask;
  __m128i narrow;  // 7 - mant
};

// bits(r K) for the FP8 value r of 8 magnitudes v = |x| / s
template <bool CLAMP>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256i scaled_code8(__m256 xv, const Bf16Consts& c) {
  __m256i ab = _mm256_castps_si256(_mm256_div_ps(xv, c.sv));
  if (CLAMP) ab = _mm256_min_epu32(ab, c.qmaxbits);
  const __m256 ck = _mm256_castsi256_ps(_mm256_max_epi32(_mm256_add_epi32(_mm256_and_si256(ab, c.expmask), c.cadd), c.csub));
  return _mm256_castps_si256(_mm256_sub_ps(_mm256_fmadd_ps(_mm256_castsi256_ps(ab), c.kv, ck), ck));
}

// The magnitude codes of 16 bf16 patterns, one per 16-bit lane, in element order.
template <bool CLAMP>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256i codes16_bf16(__m256i h, const Bf16Consts& c) {
  const __m256i ha = _mm256_and_si256(h, c.absmask);
  const __m256i even = _mm256_srli_epi32(scaled_code8<CLAMP>(_mm256_castsi256_ps(_mm256_slli_epi32(ha, 16)), c), 16);
  const __m256i odd = scaled_code8<CLAMP>(_mm256_castsi256_ps(_mm256_and_si256(ha, c.himask)), c);
  return _mm256_srl_epi16(_mm256_or_si256(even, odd), c.narrow);
}

// A row segment of n elements in groups of c with scales s[g] (0: the group is skipped): the
// constants are made once per segment, so groups of 128 cost little more than whole rows.
template <bool NZ, bool CLAMP>
__attribute__((target("avx2,fma,f16c"))) void quant_bf16_avx2(const void* x, int64_t n, int64_t c, const float* s,
                                                              const Job& j, void* out) {
  const int32_t kshift = (127 - j.f.bias) << 23;  // the exponent step of the scaling by K
  const int32_t kbits = j.f.bias << 23;           // K = 2^(bias - 127) as fp32 bits
  int32_t qbits;
  std::memcpy(&qbits, &j.qmax, 4);
  float kv;
  std::memcpy(&kv, &kbits, 4);
  Bf16Consts k{_mm256_setzero_ps(),
               _mm256_set1_ps(kv),
               _mm256_set1_epi32(qbits),
               _mm256_set1_epi32(0x7F800000),
               _mm256_set1_epi32(j.mr.cadd - kshift),
               _mm256_set1_epi32(j.mr.csub - kshift),
               _mm256_set1_epi32(0x7FFF7FFF),
               _mm256_set1_epi32((int)0xFFFF0000u),
               _mm_cvtsi32_si128(7 - j.f.mant)};
  const __m256i sign8 = _mm256_set1_epi8((char)0x80);
  const uint16_t* xp = (const uint16_t*)x;
  uint8_t* op = (uint8_t*)out;
  for (int64_t g0 = 0, g = 0; g0 < n; g0 += c, ++g) {
    if (s[g] == 0.0f) continue;
    const int64_t end = std::min(n, g0 + c);
    k.sv = _mm256_set1_ps(s[g]);
    int64_t i = g0;
    for (; i + 32 <= end; i += 32) {
      const __m256i h0 = _mm256_loadu_si256((const __m256i*)(xp + i));
      const __m256i h1 = _mm256_loadu_si256((const __m256i*)(xp + i + 16));
      const __m256i mag = _mm256_packus_epi16(codes16_bf16<CLAMP>(h0, k), codes16_bf16<CLAMP>(h1, k));
      __m256i sign = _mm256_and_si256(_mm256_packs_epi16(h0, h1), sign8);
      if (!NZ) sign = _mm256_andnot_si256(_mm256_cmpeq_epi8(mag, _mm256_setzero_si256()), sign);  // FNUZ has no -0
      // packs work within 128-bit halves: 8-byte blocks 0, 2, 1, 3 hold elements 0-7, 8-15, 16-23, 24-31
      _mm256_storeu_si256((__m256i*)(op + i), _mm256_permute4x64_epi64(_mm256_or_si256(mag, sign), 0xD8));
    }
    if (i < end) quant_scalar(x, i, end, 1, s[g], j, 0, out);
  }
}

// The constants of the AVX2 body, made once per segment.
struct Avx2Consts {
  __m256 sv, hi;  // hi = qmax: its bits clamp the magnitude
  __m256i absmask, expmask, cadd, csub, kcode;
  __m128i shc;
};

// 8 elements: the magnitude of the rounded value as fp32 bits (mode 1/2) or its FP8 magnitude
// code (mode 0), and the bits of v (for the sign). The arithmetic of quant_avx512.
template <int T, int MODE>
__attribute__((target("avx2,fma,f16c"))) inline __m256i quant8_avx2(const void* x, int64_t k, const Avx2Consts& c,
                                                                __m256i& vbits) {
  // the clamp to qmax as an integer min on the magnitude's bits (as round16 in the AVX-512 body)
  vbits = _mm256_castps_si256(_mm256_div_ps(load8(x, k, T), c.sv));
  const __m256i ab = _mm256_min_epu32(_mm256_and_si256(vbits, c.absmask), _mm256_castps_si256(c.hi));
  const __m256i C = _mm256_max_epi32(_mm256_add_epi32(_mm256_and_si256(ab, c.expmask), c.cadd), c.csub);
  const __m256i t = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(ab), _mm256_castsi256_ps(C)));
  if (MODE == 0) return _mm256_add_epi32(_mm256_sub_epi32(t, C), _mm256_sub_epi32(_mm256_srl_epi32(C, c.shc), c.kcode));
  return _mm256_castps_si256(_mm256_sub_ps(_mm256_castsi256_ps(t), _mm256_castsi256_ps(C)));  // exact
}

template <int T, int MODE, bool NZ>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void quant_avx2(const void* x, int64_t n, float s, const Job& j, void* out) {
  const Fp8Params& f = j.f;
  const MagicRound& mr = j.mr;
  const Avx2Consts c{_mm256_set1_ps(s),           _mm256_set1_ps(j.qmax),
                     _mm256_set1_epi32(0x7FFFFFFF), _mm256_set1_epi32(0x7F800000), _mm256_set1_epi32(mr.cadd),
                     _mm256_set1_epi32(mr.csub),    _mm256_set1_epi32(mr.kcode),    _mm_cvtsi32_si128(23 - f.mant)};
  const __m256i signbit = _mm256_set1_epi32(0x80), fsign = _mm256_set1_epi32((int)0x80000000u);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t k = 0;
  if (MODE == 0) {
    for (; k + 32 <= n; k += 32) {  // 4 x 8 codes, narrowed with two rounds of packs
      __m256i code[4];
      for (int i = 0; i < 4; ++i) {
        __m256i vbits;
        const __m256i mag = quant8_avx2<T, 0>(x, k + 8 * i, c, vbits);
        __m256i sign = _mm256_and_si256(_mm256_srli_epi32(vbits, 24), signbit);
        if (!NZ) sign = _mm256_andnot_si256(_mm256_cmpeq_epi32(mag, zero), sign);  // FNUZ has no -0
        code[i] = _mm256_or_si256(mag, sign);
      }
      const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(code[0], code[1]), _mm256_packus_epi32(code[2], code[3]));
      _mm256_storeu_si256((__m256i*)((uint8_t*)out + k), _mm256_permutevar8x32_epi32(p, order));
    }
  } else {
    for (; k + 16 <= n; k += 16) {
      __m256i r[2];
      for (int i = 0; i < 2; ++i) {
        __m256i vbits;
        const __m256i mag = quant8_avx2<T, MODE>(x, k + 8 * i, c, vbits);
        __m256 val = _mm256_castsi256_ps(_mm256_or_si256(mag, _mm256_and_si256(vbits, fsign)));
        if (!NZ) val = _mm256_add_ps(val, _mm256_setzero_ps());  // -0 + 0 = +0: FNUZ has no -0
        r[i] = _mm256_castps_si256(val);
      }
      if (MODE == 2) {
        _mm256_storeu_si256((__m256i*)((float*)out + k), r[0]);
        _mm256_storeu_si256((__m256i*)((float*)out + k + 8), r[1]);
      } else {  // the high halves: exact bf16 (an FP8 value has at most 4 significant bits)
        const __m256i p = _mm256_packus_epi32(_mm256_srli_epi32(r[0], 16), _mm256_srli_epi32(r[1], 16));
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + k), _mm256_permute4x64_epi64(p, 0xD8));
      }
    }
  }
  quant_scalar(x, k, n, T, s, j, MODE, out);
}

// The row-segment bodies above, run over the consecutive groups of c elements of a segment of n:
// always inlined into one loop per code path, so the constants they broadcast are made once per
// segment rather than once per group (1 x 128 groups ran well below per-row speed before:
// docs/performance.md, "Figures behind the code").
// amax[g] and bad[g] accumulate (max, or) over calls; a group whose scale s[g] is 0 is skipped.
using AmaxFn = void (*)(const void*, int64_t, int64_t, float*, char*);
using QuantFn = void (*)(const void*, int64_t, int64_t, const float*, const Job&, void*);

template <int T>
constexpr int64_t in_size() {
  return T == 0 ? 4 : 2;
}
template <int MODE>
constexpr int64_t out_size() {
  return MODE == 0 ? 1 : (MODE == 1 ? 2 : 4);
}

#define FP8REF_AMAX_GROUPS(ISA, TARGET)                                                                     \
  template <int T>                                                                                          \
  TARGET void amax_groups_##ISA(const void* x, int64_t n, int64_t c, float* amax, char* bad) {              \
    for (int64_t g0 = 0, g = 0; g0 < n; g0 += c, ++g) {                                                     \
      bool b = false;                                                                                       \
      amax_##ISA<T>((const char*)x + g0 * in_size<T>(), std::min(c, n - g0), amax[g], b);                   \
      if (b) bad[g] = 1;                                                                                    \
    }                                                                                                       \
  }
#define FP8REF_QUANT_GROUPS(ISA, TARGET)                                                                    \
  template <int T, int MODE, bool NZ>                                                                       \
  TARGET void quant_groups_##ISA(const void* x, int64_t n, int64_t c, const float* s, const Job& j, void* out) { \
    for (int64_t g0 = 0, g = 0; g0 < n; g0 += c, ++g)                                                       \
      if (s[g] != 0.0f)                                                                                     \
        quant_##ISA<T, MODE, NZ>((const char*)x + g0 * in_size<T>(), std::min(c, n - g0), s[g], j,          \
                                 (char*)out + g0 * out_size<MODE>());                                       \
  }

// The largest uint16 of each of a[0..7] (8 lanes each), as lane g of the result: three rounds of
// interleaving unpacks and maxima (21 operations for 8 groups, against 6 per group for a
// phminposuw reduction and its scalar follow-up).
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m128i max_lanes8_epu16(const __m128i* a) {
  __m128i p[4], q[2];
  for (int i = 0; i < 4; ++i)  // 32-bit element e: (group 2i, group 2i + 1) partials of lanes e, e + 4
    p[i] = _mm_max_epu16(_mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]), _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // 64-bit halves: groups 4i .. 4i + 3, two partials each
    q[i] = _mm_max_epu16(_mm_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
  return _mm_max_epu16(_mm_unpacklo_epi64(q[0], q[1]), _mm_unpackhi_epi64(q[0], q[1]));
}

// amax_groups_avx2 for bf16/fp16 in groups of c (a multiple of 16): eight whole groups at a time,
// each reduced to 8 lanes of magnitude patterns, the eight reduced together (max_lanes8_epu16) and
// widened to fp32 in one go; the remaining groups as amax_avx2. The same maxima: a max of patterns
// is the pattern of the max.
template <int T>
__attribute__((target("avx2,fma,f16c"))) void amax_groups16_avx2(const void* x, int64_t n, int64_t c, float* amax,
                                                                 char* bad) {
  const __m256i magmask = _mm256_set1_epi16(0x7FFF);
  const __m256i finite = _mm256_set1_epi32(T == 1 ? 0x7F7F : 0x7BFF);  // the largest finite magnitude pattern
  const uint16_t* xp = (const uint16_t*)x;
  int64_t g = 0;
  for (; (g + 8) * c <= n; g += 8) {
    __m128i part[8];
    for (int i = 0; i < 8; ++i) {
      const uint16_t* p = xp + (g + i) * c;
      __m256i m = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)p), magmask);
      for (int64_t k = 16; k < c; k += 16)
        m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(p + k)), magmask));
      part[i] = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    }
    const __m128i top = max_lanes8_epu16(part);
    const __m256i wide = _mm256_cvtepu16_epi32(top);
    const int nonfinite = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(wide, finite)));
    const __m256 f = T == 1 ? _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)) : _mm256_cvtph_ps(top);
    // non-negative fp32 (and the NaN/Inf ones, whose blocks are dropped) order like their bits
    const __m256i old = _mm256_loadu_si256((const __m256i*)(amax + g));
    _mm256_storeu_si256((__m256i*)(amax + g), _mm256_max_epi32(old, _mm256_castps_si256(f)));
    if (nonfinite)
      for (int i = 0; i < 8; ++i)
        if (nonfinite >> i & 1) bad[g + i] = 1;
  }
  for (int64_t g0 = g * c; g0 < n; g0 += c, ++g) {
    bool b = false;
    amax_avx2<T>(xp + g0, std::min(c, n - g0), amax[g], b);
    if (b) bad[g] = 1;
  }
}

// AVX2: bf16 to codes takes its own body (every format: each has smallest normal 2^(1 - bias)).
template <int T, int MODE, bool NZ>
__attribute__((target("avx2,fma,f16c"))) void quant_groups_avx2(const void* x, int64_t n, int64_t c, const float* s,
                                                                const Job& j, void* out) {
  if (T == 1 && MODE == 0 && j.f.emin == 1 - j.f.bias)
    return j.qmax_on_grid ? quant_bf16_avx2<NZ, false>(x, n, c, s, j, out) : quant_bf16_avx2<NZ, true>(x, n, c, s, j, out);
  for (int64_t g0 = 0, g = 0; g0 < n; g0 += c, ++g)
    if (s[g] != 0.0f)
      quant_avx2<T, MODE, NZ>((const char*)x + g0 * in_size<T>(), std::min(c, n - g0), s[g], j,
                              (char*)out + g0 * out_size<MODE>());
}

template <int T>
inline void amax_plain(const void* x, int64_t n, float& amax, bool& bad) {
  amax_scalar(x, 0, n, T, amax, bad);
}
template <int T, int MODE, bool NZ>
inline void quant_plain(const void* x, int64_t n, float s, const Job& j, void* out) {
  quant_scalar(x, 0, n, T, s, j, MODE, out);
}

FP8REF_AMAX_GROUPS(avx512, __attribute__((target("avx512f,avx512bw"))))
FP8REF_AMAX_GROUPS(avx2, __attribute__((target("avx2,fma,f16c"))))
FP8REF_AMAX_GROUPS(plain, )
FP8REF_QUANT_GROUPS(avx512, __attribute__((target("avx512f,avx512bw"))))
FP8REF_QUANT_GROUPS(plain, )
#undef FP8REF_AMAX_GROUPS
#undef FP8REF_QUANT_GROUPS

// The instantiation for (isa, input type, mode, -0) chosen once per call.
template <int T>
AmaxFn amax_for(int64_t isa, int64_t c, int64_t k) {
  if (isa == 1 && T != 0 && c % 16 == 0 && c < k) return amax_groups16_avx2<T>;  // several groups per row segment
  return isa == 2 ? amax_groups_avx512<T> : (isa == 1 ? amax_groups_avx2<T> : amax_groups_plain<T>);
}
template <int T, int MODE, bool NZ>
QuantFn quant_for3(int64_t isa) {
  return isa == 2 ? quant_groups_avx512<T, MODE, NZ>
                  : (isa == 1 ? quant_groups_avx2<T, MODE, NZ> : quant_groups_plain<T, MODE, NZ>);
}
template <int T, int MODE>
QuantFn quant_for2(int64_t isa, bool nz) {
  return nz ? quant_for3<T, MODE, true>(isa) : quant_for3<T, MODE, false>(isa);
}
template <int T>
QuantFn quant_for1(int64_t isa, int mode, bool nz) {
  return mode == 0 ? quant_for2<T, 0>(isa, nz) : (mode == 1 ? quant_for2<T, 1>(isa, nz) : quant_for2<T, 2>(isa, nz));
}

// The spec's scale of a block with this amax (compute_scale, fp32 scale_dtype); 0 if it overflows.
float block_scale(float amax, float qmax, float floor, bool pow2) {
  float s = std::max(amax, floor) / qmax;
  if (s == 0.0f) s = 1.0f;
  if (!std::isfinite(s)) return 0.0f;  // before frexp, whose exponent of +inf is unspecified (glibc: 0, so s was 1)
  if (pow2) {  // frexp: s = m 2^e, 0.5 <= m < 1; a power of two (m == 0.5) stays, others round up
    int e;
    const float m = std::frexp(s, &e);
    s = std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
  }
  s = std::max(s, FLT_MIN);
  return std::isfinite(s) ? s : 0.0f;
}

// The scales of n blocks from their amaxes a[] and NaN/Inf flags bad[]: into s[] the scale the
// quantizer divides by (0: the block holds NaN or Inf or its scale overflows; it is skipped), into
// scale[] the one returned (1 there) and into amax_out[] the amax returned (+inf there).
using ScalesFn = void (*)(const float*, const char*, int64_t, float, float, bool, float*, float*, float*);

void block_scales_plain(const float* a, const char* bad, int64_t n, float qmax, float floor, bool pow2, float* s,
                        float* scale, float* amax_out) {
  for (int64_t i = 0; i < n; ++i) {
    s[i] = bad[i] ? 0.0f : block_scale(a[i], qmax, floor, pow2);
    scale[i] = s[i] == 0.0f ? 1.0f : s[i];
    amax_out[i] = s[i] == 0.0f ? INFINITY : a[i];
  }
}

// block_scale on 8 blocks per step (with the per-group amax reductions, the scalar scales had cost
// about three times the cycles per 1 x 128 group beyond a row's work that remain with this and
// amax_groups16_avx2: docs/performance.md, "Figures behind the code"): the same IEEE operations in
// the same order; the maxima as std::max's (the amaxes of kept blocks are never NaN); the power of
// two at or above a positive s (frexp/ldexp above) as bits(s) + 0x7FFFFF with the mantissa field
// cleared, exact for normal and subnormal s (a subnormal becomes FLT_MIN, as the max with FLT_MIN
// makes it anyway) and +inf for s above 2^127 (which the finiteness test then drops, as ldexp's
// +inf).
__attribute__((target("avx2,fma,f16c"))) void block_scales_avx2(const float* a, const char* bad, int64_t n, float qmax,
                                                                float floor, bool pow2, float* s, float* scale,
                                                                float* amax_out) {
  const __m256 qv = _mm256_set1_ps(qmax), fv = _mm256_set1_ps(floor), one = _mm256_set1_ps(1.0f);
  const __m256 tiny = _mm256_set1_ps(FLT_MIN), inf = _mm256_set1_ps(INFINITY);
  const __m256i expmask = _mm256_set1_epi32(0x7F800000), mant = _mm256_set1_epi32(0x007FFFFF);
  const __m256i top9 = _mm256_set1_epi32((int)0xFF800000u), zero = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    __m256 sv = _mm256_div_ps(_mm256_max_ps(av, fv), qv);
    sv = _mm256_blendv_ps(sv, one, _mm256_cmp_ps(sv, _mm256_setzero_ps(), _CMP_EQ_OQ));
    if (pow2) sv = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(sv), mant), top9));
    sv = _mm256_max_ps(sv, tiny);
    const __m256i flagged = _mm256_cmpgt_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(bad + i))), zero);
    const __m256i nonfinite = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(sv), expmask), expmask);
    const __m256 drop = _mm256_castsi256_ps(_mm256_or_si256(flagged, nonfinite));
    _mm256_storeu_ps(s + i, _mm256_andnot_ps(drop, sv));
    _mm256_storeu_ps(scale + i, _mm256_blendv_ps(sv, one, drop));
    _mm256_storeu_ps(amax_out + i, _mm256_blendv_ps(av, inf, drop));
  }
  block_scales_plain(a + i, bad + i, n - i, qmax, floor, pow2, s + i, scale + i, amax_out + i);
}

}  // namespace

int64_t cpu_isa() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
  return 0;
}

// x [M, K] fp32/bf16/fp16 contiguous, blocks of r x c (r = M, c = K: one scale for the tensor) ->
// (out [M, K]: uint8 codes, bf16 or fp32 values; scale [ceil(M/r), ceil(K/c)]; amax, same shape,
// +inf for a block holding NaN or Inf or whose scale overflows fp32: nothing of it is written then).
// isa: -1 the best this CPU has, else 0 scalar, 1 AVX2, 2 AVX-512 (tests force each one).
std::vector<at::Tensor> quant_blocks(at::Tensor x, int64_t r, int64_t c, double qmax, double floor, int64_t mant,
                                     int64_t emin, int64_t bias, bool negzero, bool pow2, int64_t mode, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D tensor");
  TORCH_CHECK(x.device().is_cpu(), "quant_blocks: x must be a CPU tensor, got ", x.device());
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "x must be fp32/bf16/fp16");
  TORCH_CHECK(mode >= 0 && mode <= 2, "mode must be 0, 1 or 2");
  TORCH_CHECK(r >= 1 && c >= 1, "quant_blocks: block sizes must be >= 1, got ", r, " x ", c);
  // The rounding shifts by 23 - mant bits and the scale divides by qmax: keep both well defined.
  TORCH_CHECK(mant >= 1 && mant <= 3, "quant_blocks: an FP8 format has 1 to 3 mantissa bits, got ", mant);
  TORCH_CHECK(bias >= 1 && bias <= 31, "quant_blocks: an FP8 exponent bias is 1 to 31, got ", bias);
  TORCH_CHECK(std::isfinite(qmax) && qmax > 0 && std::isfinite(floor) && floor >= 0,
              "quant_blocks: qmax must be finite and > 0 and floor finite and >= 0, got ", qmax, " and ", floor);
  const int64_t best = cpu_isa();
  if (isa < 0) isa = best;
  const CsrGuard csr;  // this thread's part (the scales); each parallel_for body makes its own
  TORCH_CHECK(isa <= best, "this CPU lacks the instructions of code path ", isa);
  const int t = st == at::kFloat ? 0 : (st == at::kBFloat16 ? 1 : 2);
  const int64_t M = x.size(0), K = x.size(1);
  // A block larger than the tensor is the tensor: clipping keeps r * c and the counts below from overflowing.
  r = std::min(r, std::max<int64_t>(M, 1));
  c = std::min(c, std::max<int64_t>(K, 1));
  const int64_t R = (M + r - 1) / r, C = (K + c - 1) / c;
  const auto odt = mode == 0 ? at::kByte : (mode == 1 ? at::kBFloat16 : at::kFloat);
  auto out = at::empty({M, K}, at::dtype(odt));
  auto scale = at::empty({R, C}, at::dtype(at::kFloat));
  auto amax = at::empty({R, C}, at::dtype(at::kFloat));
  if (M == 0 || K == 0) return {out, scale, amax};
  const Fp8Params fp{(int)mant, (int)emin, (int)bias, negzero};
  const Job job{fp, (float)qmax, magic_round(fp), fp8_round((float)qmax, fp) == (float)qmax};
  const AmaxFn amax_fn = t == 0 ? amax_for<0>(isa, c, K) : (t == 1 ? amax_for<1>(isa, c, K) : amax_for<2>(isa, c, K));
  const ScalesFn scales_fn = isa >= 1 ? block_scales_avx2 : block_scales_plain;
  const int md = (int)mode;
  const QuantFn quant_fn = t == 0   ? quant_for1<0>(isa, md, negzero)
                           : t == 1 ? quant_for1<1>(isa, md, negzero)
                                    : quant_for1<2>(isa, md, negzero);
  const char* xp = (const char*)x.data_ptr();
  char* op = (char*)out.data_ptr();
  float* sp = scale.data_ptr<float>();
  float* ap = amax.data_ptr<float>();
  const int64_t isz = x.element_size(), osz = out.element_size();
  const float fq = (float)qmax, ff = (float)floor;

  if (R == 1 && C == 1 && M > 1) {
    // One scale for the tensor: row amaxes in parallel, their max, then the rows in parallel.
    std::vector<float> row_amax(M, 0.0f);
    std::vector<char> row_bad(M, 0);
    at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
      const CsrGuard csr;
      for (int64_t m = m0; m < m1; ++m) amax_fn(xp + m * K * isz, K, K, &row_amax[m], &row_bad[m]);
    });
    float a = 0.0f;
    bool bad = false;
    for (int64_t m = 0; m < M; ++m) {
      a = std::max(a, row_amax[m]);
      bad = bad || row_bad[m];
    }
    const char flag = bad;
    float s;
    block_scales_plain(&a, &flag, 1, fq, ff, pow2, &s, sp, ap);
    if (s == 0.0f) return {out, scale, amax};
    at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
      const CsrGuard csr;
      for (int64_t m = m0; m < m1; ++m) quant_fn(xp + m * K * isz, K, K, &s, job, op + m * K * osz);
    });
    return {out, scale, amax};
  }

  if (r == 1) {
    // Blocks one row high: a whole row per work item, its groups' amaxes in one pass, then the row
    // quantized while it is still in L1/L2.
    at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
      const CsrGuard csr;
      std::vector<float> ba(C), bs(C);
      std::vector<char> bb(C);
      for (int64_t m = m0; m < m1; ++m) {
        std::fill(ba.begin(), ba.end(), 0.0f);
        std::fill(bb.begin(), bb.end(), 0);
        amax_fn(xp + m * K * isz, K, c, ba.data(), bb.data());
        scales_fn(ba.data(), bb.data(), C, fq, ff, pow2, bs.data(), sp + m * C, ap + m * C);
        quant_fn(xp + m * K * isz, K, c, bs.data(), job, op + m * K * osz);
      }
    });
    return {out, scale, amax};
  }

  // Taller blocks: work items are strips of r rows by a run of `cb` whole blocks (about 4096
  // columns). Both passes (the blocks' amaxes, then the quantization) walk the strip row by row,
  // so each row segment is one sequential stream. Walking one r x c block at a time instead read
  // r short segments a row pitch apart, clearly slower; 1024-column runs (whose second pass should
  // hit L2) did not pay either (docs/performance.md, "Figures behind the code").
  const int64_t cb = std::max<int64_t>(1, 4096 / c), runs = (C + cb - 1) / cb;
  at::parallel_for(0, R * runs, 1, [&](int64_t i0, int64_t i1) {
    const CsrGuard csr;
    std::vector<float> ba(cb), bs(cb);
    std::vector<char> bb(cb);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t bi = item / runs, j0 = (item % runs) * cb, j1 = std::min(C, j0 + cb);
      const int64_t m0 = bi * r, m1 = std::min(M, m0 + r);
      std::fill(ba.begin(), ba.end(), 0.0f);
      std::fill(bb.begin(), bb.end(), 0);
      const int64_t k0 = j0 * c, kn = std::min(K, j1 * c) - k0;  // the run's columns
      for (int64_t m = m0; m < m1; ++m) amax_fn(xp + (m * K + k0) * isz, kn, c, ba.data(), bb.data());
      scales_fn(ba.data(), bb.data(), j1 - j0, fq, ff, pow2, bs.data(), sp + bi * C + j0, ap + bi * C + j0);
      for (int64_t m = m0; m < m1; ++m) quant_fn(xp + (m * K + k0) * isz, kn, c, bs.data(), job, op + (m * K + k0) * osz);
    }
  });
  return {out, scale, amax};
}

}  // namespace fp8ref
