// Decoding E4M3FN codes, shared by the two GEMMs (gemm.cpp, gemm_packed.cpp).
//
// E4M3FN code c -> fp16 bits ((c & 0x7F) << 7 | sign << 15) is the value times 2^-8, exactly, for
// every finite code (normal and subnormal): E4M3's exponent bias is 7, fp16's 15. NaN codes
// (0x7F, 0xFF) would read as 480; the Python side refuses them before calling a GEMM.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fp8ref {

static inline float decode_compute(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float mag = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return std::ldexp((c & 0x80) ? -mag : mag, -8);  // same 2^-8 offset as the vector path
}

// Computed once: two ldexp calls per element had made the activation decoding slow
// (docs/performance.md, "Figures behind the code"), and every scalar loop (tails, the fallback)
// decodes per element.
struct DecodeTables {
  float value[256];    // decode_compute(c): the value times 2^-8
  uint16_t bf16[256];  // the exact value's bf16 bits (<= 4 significant bits)
  DecodeTables() {
    for (int c = 0; c < 256; ++c) {
      value[c] = decode_compute((uint8_t)c);
      const float v = value[c] * 256.0f;
      uint32_t u;
      std::memcpy(&u, &v, 4);
      bf16[c] = (uint16_t)(u >> 16);
    }
  }
};
inline const DecodeTables kDecode;

// The value of code c times 2^-8.
static inline float decode_scalar(uint8_t c) { return kDecode.value[c]; }

// The exact bf16 bits of code c's value.
static inline uint16_t bf16_of_code(uint8_t c) { return kDecode.bf16[c]; }

// 16 codes -> their values times 2^-8, through the fp16 bit pattern.
__attribute__((target("avx512f,avx512bw,f16c"))) static inline __m512 decode16(const uint8_t* p) {
  __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  __m256i mag = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 7);
  __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8);
  return _mm512_cvtph_ps(_mm256_or_si256(mag, sgn));
}

// 32 codes -> their exact bf16 bit patterns (one vdpbf16ps operand). Normal codes: (c & 0x7F) << 4
// plus 120 << 7 rebiases the exponent (7 -> 127); the 8 subnormal codes m * 2^-9 come from a table.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static inline __m512i decode32_bf16(const uint8_t* p) {
  const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0x0000);
  const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7F));
  __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  bits = _mm512_mask_permutexvar_epi16(bits, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, table);
  // bits | ((c << 8) & 0x8000): the sign, in one ternary-logic op (0xF8 = A | (B & C))
  return _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(c, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}

// The same for 32 codes that hold no zero or subnormal magnitude (pack_weight flags those groups):
// the exponent rebias alone, no table lookup.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static inline __m512i decode32_bf16_normal(
    const uint8_t* p) {
  const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x7F)), 4),
                                        _mm512_set1_epi16(0x3C00));
  return _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(c, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}

}  // namespace fp8ref
