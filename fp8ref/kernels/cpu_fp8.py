"""The ``cpu-fp8`` backend: a C++ kernel that reads the 1-byte FP8 weights directly (decode / small M).

For a few rows (decode) a linear layer is bound by reading the weight; a bf16 copy of the weight costs
two bytes per element, the FP8 codes one. Where the CPU has avx512_bf16, ``prepare_weight`` packs the
``[N, K]`` E4M3FN codes as ``[N/16, K/2, 16, 2]`` (``pack_weight``), the kernel decodes 32 codes at a
time to their exact bf16 bit patterns (one ``vdpbf16ps`` operand: 16 output columns x 2 K-steps) and
up to 16 activation rows share each decoded vector through broadcast pairs. Every product of two FP8
values is exact in fp32 and each addition rounds once in fp32; the epilogue ``(acc * sa) * sb +
bias`` is fp32, and torch rounds the fp32 result once to ``out_dtype``: ``Accumulation.FP32``,
``output_roundings=1`` (strict class). Without avx512_bf16: the codes are widened to fp16 bit patterns
(``(c & 0x7F) << 7 | sign << 15`` is the value times 2**-8 for every finite code) and multiplied-added
in fp32 (AVX-512 + F16C), or a scalar loop; same declaration.

The same extension holds the fused per-row quantizer (``quant_rows``) and scale epilogue
(``scale_epilogue``) used by ``fast_quantize``, ``cpu-bf16`` and ``cpu-fp32`` when it is built
(``native()``); they are bit-identical to the spec and to the eager torch code.

The kernel is compiled with ``torch.utils.cpp_extension`` (g++, ninja, OpenMP) into torch's extension
cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``). Building takes about half
a minute to a minute on a 2-core machine, so it is never done implicitly by a listing or a selection:
the backend is available once the build exists, and ``python -m fp8ref.kernels.cpu_fp8`` (or
``FP8REF_CPU_FP8=1``, which builds on first use) makes it.

Declines: other formats than E4M3FN, block/group scales (tensor and row only), non-CPU tensors, and
more than ``MAX_M`` rows (``MAX_M_FALLBACK`` without avx512_bf16). The packed kernel is strict-class
and beats bf16 ``F.linear`` up to M = 64 here, ties it at 128-256, and falls behind beyond.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading

import torch

from .._machine import cpu_flags
from ..registry import Backend, Case, register_backend
from ..spec.bounds import Accumulation
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._common import PreparedWeight, bias_fp32, check_mm_args, fast_quantize, unwrap

__all__ = ["CpuFp8Backend", "build", "native", "pack_weight", "MAX_M", "MAX_M_FALLBACK", "PACKED_ROWS"]

#: Rows beyond which the packed kernel declines. On this 2-core EPYC (quiet, Llama-3.1-8B shapes) it
#: ran at 1.45-1.8x bf16 ``F.linear``'s speed at M = 16, 1.04-1.17x at 64, 0.95-1.03x at 128,
#: 0.91-0.99x at 256 and 0.70-0.86x at 1024, where oneDNN's bf16 GEMM (cpu-bf16, 0.93-1.0x) wins.
#: The selector times buckets above 128 rows at 128 rows, so a larger limit could pick it there.
MAX_M = 256
#: Rows beyond which the fallback kernels (no avx512_bf16: fp16 decoding + fp32 FMAs, or scalar)
#: decline: one core of this EPYC measured that path at 0.78-1.27x bf16 ``F.linear`` at M = 4 and
#: 0.45x at M = 16.
MAX_M_FALLBACK = 4
#: Rows per call of the packed kernel: its activation pairs (K/2 x rows x 4 bytes) stay in L2
#: (2 MiB at K = 4096); 1024 rows at K = 14336 (29 MiB) ran 4x slower per row than 256.
PACKED_ROWS = 256

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>
#include <cfloat>
#include <algorithm>
#include <c10/util/Half.h>

// E4M3FN code c -> fp16 bits ((c & 0x7F) << 7 | sign << 15) is the value times 2^-8, exactly, for
// every finite code (normal and subnormal): E4M3's exponent bias is 7, fp16's 15.
// Computed once into a table: two ldexp calls per element had cost 0.8 ms per call at M = 16,
// K = 4096 in the activation decoding, and every scalar loop (tails, the fallback) decodes per element.
static float decode_compute(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float mag = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return std::ldexp((c & 0x80) ? -mag : mag, -8);  // same 2^-8 offset as the vector path
}

struct DecodeTables {
  float value[256];     // decode_compute(c): the value times 2^-8
  uint16_t bf16[256];   // the exact value's bf16 bits (<= 4 significant bits)
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
static const DecodeTables kDecode;

static inline float decode_scalar(uint8_t c) { return kDecode.value[c]; }

__attribute__((target("avx512f,avx512bw,f16c")))
static inline __m512 decode16(const uint8_t* p) {
  __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  __m256i mag = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 7);
  __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8);
  return _mm512_cvtph_ps(_mm256_or_si256(mag, sgn));
}

// acc[m, n] = sum_k a[m, k] b[n, k] (decoded values, times 2^-16), fp32 FMAs: every product of two
// FP8 values is exact in fp32, so each FMA rounds once, like an fp32 addition.
template <int MM>
__attribute__((target("avx512f,avx512bw,f16c")))
static void rows_avx512_t(const float* ad, int64_t K, const uint8_t* b, int64_t n0, int64_t n1, float* acc,
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
static void rows_avx512(const float* ad, int64_t M, int64_t K, const uint8_t* b, int64_t n0, int64_t n1,
                        float* acc) {
  const int64_t ld = n1 - n0;
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) rows_avx512_t<8>(ad + m * K, K, b, n0, n1, acc + m * ld, ld);
  if (m + 4 <= M) { rows_avx512_t<4>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 4; }
  if (m + 2 <= M) { rows_avx512_t<2>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 2; }
  if (m + 1 <= M) { rows_avx512_t<1>(ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 1; }
}

// avx512_bf16 path: codes -> bf16 bit patterns, 32 at a time, then vdpbf16ps (products of bf16
// values are exact in fp32; each of the two additions per lane rounds in fp32, like an fp32 sum).
// Normal codes: (c & 0x7F) << 4 plus 120 << 7 rebiases the exponent (7 -> 127); the 8 subnormal
// codes m * 2^-9 come from a table.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline __m512i decode32_bf16(const uint8_t* p) {
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
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline __m512i decode32_bf16_normal(const uint8_t* p) {
  const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x7F)), 4),
                                        _mm512_set1_epi16(0x3C00));
  return _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(c, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}

static inline uint16_t bf16_of_code(uint8_t c) { return kDecode.bf16[c]; }

static void rows_scalar(const float* ad, int64_t M, int64_t K, const uint8_t* b, int64_t n0, int64_t n1,
                        float* acc) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float t = 0.f;
      for (int64_t k = 0; k < K; ++k) t = std::fma(ad[m * K + k], decode_scalar(b[n * K + k]), t);
      acc[m * (n1 - n0) + (n - n0)] = t;
    }
  }
}


// ---------------------------------------------------------------------------------------------
// Packed path (avx512_bf16): the weight codes are re-laid out once, at prepare_weight time, as
// [N/16][K/2][16][2] (zero-padded to N % 16 == 0 and K % 2 == 0), so that 32 consecutive codes
// decode to one vdpbf16ps operand holding 16 output columns x 2 K-steps. Each activation row
// contributes a broadcast (a[m, 2p], a[m, 2p + 1]) pair, and up to 16 rows share each decoded
// vector: every weight code is decoded once per 16 rows, and the 16 accumulators are output
// columns (no horizontal sums). Each lane accumulates its column's products in K order, two per
// instruction, one fp32 rounding per addition (products of FP8 values are exact in fp32, and
// partial sums are multiples of 2^-18: never subnormal, so the instruction's DAZ/FTZ never acts).

// acc += b . broadcast(*a): vdpbf16ps with an embedded {1to16} memory broadcast. Written in asm
// because GCC emits a separate vpbroadcastd, which competes with vdpbf16ps for the vector pipes
// (measured: 35 cycles per 16 dot products instead of about 16).
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline void dpbf16_bcast(__m512& acc, __m512bh b, const uint32_t* a) {
  asm("vdpbf16ps %[a]%{1to16%}, %[b], %[acc]" : [acc] "+v"(acc) : [b] "v"(b), [a] "m"(*a));
}

template <int MM>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void packed_block(const uint32_t* apair, int64_t lda, int64_t K2, const uint8_t* pb, const uint8_t* special,
                         float* out, int64_t ldo) {
  __m512 s[MM];
#pragma GCC unroll 16
  for (int i = 0; i < MM; ++i) s[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    const __m512bh bv = (__m512bh)(special[p] ? decode32_bf16(pb + p * 32) : decode32_bf16_normal(pb + p * 32));
#pragma GCC unroll 16
    for (int i = 0; i < MM; ++i)
      dpbf16_bcast(s[i], bv, apair + p * lda + i);
  }
#pragma GCC unroll 16
  for (int i = 0; i < MM; ++i) _mm512_storeu_ps(out + i * ldo, s[i]);
}

// apair is [K2][M] (p-major): the rows' pairs for one K-step share a cache line.
static void packed_rows(const uint32_t* apair, int64_t M, int64_t K2, const uint8_t* pb, const uint8_t* sp, float* out,
                        int64_t ldo) {
  int64_t m = 0;
  for (; m + 16 <= M; m += 16) packed_block<16>(apair + m, M, K2, pb, sp, out + m * ldo, ldo);
  for (; m + 8 <= M; m += 8) packed_block<8>(apair + m, M, K2, pb, sp, out + m * ldo, ldo);
  const uint32_t* ap = apair + m;
  float* op = out + m * ldo;
  switch (M - m) {
    case 0: break;
    case 1: packed_block<1>(ap, M, K2, pb, sp, op, ldo); break;
    case 2: packed_block<2>(ap, M, K2, pb, sp, op, ldo); break;
    case 3: packed_block<3>(ap, M, K2, pb, sp, op, ldo); break;
    case 4: packed_block<4>(ap, M, K2, pb, sp, op, ldo); break;
    case 5: packed_block<5>(ap, M, K2, pb, sp, op, ldo); break;
    case 6: packed_block<6>(ap, M, K2, pb, sp, op, ldo); break;
    default: packed_block<7>(ap, M, K2, pb, sp, op, ldo); break;
  }
}

bool has_bf16_dot() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// a: [M, K] codes; pb: packed weight [N16, K2, 16, 2] codes; out[m, n] = (acc * sa[m]) * sb[n] (+ bias[n]), fp32.
torch::Tensor fp8_e4m3_gemm_packed(torch::Tensor a, torch::Tensor pb, torch::Tensor special, int64_t N,
                                   torch::Tensor sa, torch::Tensor sb, torch::Tensor bias, bool has_bias) {
  TORCH_CHECK(has_bf16_dot(), "the packed cpu-fp8 path needs avx512_bf16");
  TORCH_CHECK(a.dtype() == torch::kUInt8 && pb.dtype() == torch::kUInt8, "codes must be uint8 views");
  TORCH_CHECK(a.is_contiguous() && pb.is_contiguous() && pb.dim() == 4, "contiguous a, packed [N16, K2, 16, 2] b");
  const int64_t M = a.size(0), K = a.size(1), N16 = pb.size(0), K2 = pb.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && N16 == (N + 15) / 16 && pb.size(2) == 16 && pb.size(3) == 2, "packed shape");
  TORCH_CHECK(special.dtype() == torch::kUInt8 && special.is_contiguous() && special.numel() == N16 * K2,
              "special must be uint8 [N16, K2]");
  const uint8_t* spp = special.data_ptr<uint8_t>();
  auto out = torch::empty({M, N}, torch::dtype(torch::kFloat32));
  if (M == 0 || N == 0) return out;
  std::vector<uint32_t> apair(K2 * M, 0);  // [p][m]: (a[m, 2p], a[m, 2p + 1]) as bf16 bits, zero-padded
  const uint8_t* ap = a.data_ptr<uint8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      apair[(k / 2) * M + m] |= (uint32_t)bf16_of_code(ap[m * K + k]) << (16 * (k & 1));
  const float* sap = sa.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const uint8_t* pbp = pb.data_ptr<uint8_t>();
  at::parallel_for(0, N16, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * 16);
    for (int64_t nb = b0; nb < b1; ++nb) {
      packed_rows(apair.data(), M, K2, pbp + nb * K2 * 32, spp + nb * K2, acc.data(), 16);
      const int64_t n0 = nb * 16, n1 = std::min(N, n0 + 16);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) {
          float y = acc[m * 16 + (n - n0)] * sap[m];
          y = y * sbp[n];
          if (bp) y = y + bp[n];
          op[m * N + n] = y;
        }
    }
  });
  return out;
}

// out[m, n] = (acc * 2^16) * sa[m] * sb[n] (+ bias[n]), fp32.
torch::Tensor fp8_e4m3_gemm(torch::Tensor a, torch::Tensor b, torch::Tensor sa, torch::Tensor sb,
                            torch::Tensor bias, bool has_bias) {
  TORCH_CHECK(a.dtype() == torch::kUInt8 && b.dtype() == torch::kUInt8, "codes must be uint8 views");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "codes must be contiguous");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
    TORCH_CHECK(b.size(1) == K, "K mismatch");
  auto out = torch::empty({M, N}, torch::dtype(torch::kFloat32));
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


// ---------------------------------------------------------------------------------------------
// Fused per-row quantization and the scale epilogue, for every CPU backend (cpu-bf16, cpu-fp32,
// cpu-fp8). Same expressions, same order as fp8ref.spec.quant.quantize: amax in fp32 (exact),
// s = max(amax, floor) / qmax in fp32 (s == 0 -> 1, then at least FLT_MIN), v = x / s as one IEEE
// fp32 division, clamp to +-qmax, one round-to-nearest-even onto the FP8 grid. The rounded value
// is written as FP8 codes (mode 0), as its exact bf16 (mode 1) or fp32 (mode 2) value.

struct Fp8Params { int mant, emin, bias; bool negzero; };

// RNE of a finite v with |v| <= the format's max onto the FP8 grid; returns the exact value.
static inline float fp8_round(float v, const Fp8Params& f) {
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
static inline uint8_t fp8_code(float r, const Fp8Params& f) {
  uint32_t u;
  std::memcpy(&u, &r, 4);
  uint32_t sign = (u >> 24) & 0x80, mag;
  const float a = std::fabs(r);
  if (a < std::ldexp(1.0f, f.emin)) mag = (uint32_t)(a * std::ldexp(1.0f, f.mant - f.emin));
  else mag = ((u >> (23 - f.mant)) & ((1u << (8 + f.mant)) - 1)) - ((uint32_t)(127 - f.bias) << f.mant);
  if (mag == 0 && !f.negzero) sign = 0;  // FNUZ formats have no -0 (0x80 is their NaN)
  return (uint8_t)(sign | mag);
}

static inline float load_one(const void* p, int64_t i, int t) {
  if (t == 0) return ((const float*)p)[i];
  const uint16_t h = ((const uint16_t*)p)[i];
  if (t == 1) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

static inline uint16_t bf16_bits(float f) {  // RNE, NaN stays NaN (c10::BFloat16's rounding)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void store_one(void* out, int64_t i, float r, int mode, const Fp8Params& f) {
  if (!f.negzero) r = r + 0.0f;  // -0 + 0 = +0: FNUZ has no -0
  if (mode == 0) ((uint8_t*)out)[i] = fp8_code(r, f);
  else if (mode == 1) {
    uint32_t u;
    std::memcpy(&u, &r, 4);
    ((uint16_t*)out)[i] = (uint16_t)(u >> 16);  // exact: an FP8 value has at most 4 significant bits
  } else ((float*)out)[i] = r;
}

__attribute__((target("avx512f,avx512bw")))
static inline __m512 load16(const void* p, int64_t i, int t) {
  if (t == 0) return _mm512_loadu_ps((const float*)p + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
  if (t == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// One row: returns amax (+inf if the row holds NaN or Inf; nothing is written then).
__attribute__((target("avx512f,avx512bw")))
static float quant_row_avx512(const void* x, int64_t K, int t, float qmax, float floor, const Fp8Params& f,
                              int mode, void* out, float* s_out) {
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

static float quant_row_scalar(const void* x, int64_t K, int t, float qmax, float floor, const Fp8Params& f,
                              int mode, void* out, float* s_out) {
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

// x [M, K] fp32/bf16/fp16 contiguous -> (out [M, K]: uint8 codes, bf16 or fp32 values; scale [M, 1];
// amax [M, 1], +inf for a row holding NaN or Inf).
std::vector<torch::Tensor> quant_rows(torch::Tensor x, double qmax, double floor, int64_t mant, int64_t emin,
                                      int64_t bias, bool negzero, int64_t mode, bool vector) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D tensor");
  const auto st = x.scalar_type();
  TORCH_CHECK(st == torch::kFloat32 || st == torch::kBFloat16 || st == torch::kHalf, "x must be fp32/bf16/fp16");
  TORCH_CHECK(mode >= 0 && mode <= 2, "mode must be 0, 1 or 2");
  const int t = st == torch::kFloat32 ? 0 : (st == torch::kBFloat16 ? 1 : 2);
  const int64_t M = x.size(0), K = x.size(1);
  const auto odt = mode == 0 ? torch::kUInt8 : (mode == 1 ? torch::kBFloat16 : torch::kFloat32);
  auto out = torch::empty({M, K}, torch::dtype(odt));
  auto scale = torch::empty({M, 1}, torch::dtype(torch::kFloat32));
  auto amax = torch::empty({M, 1}, torch::dtype(torch::kFloat32));
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

// One row of the epilogue: out[n] = round((y[n] * sa) * sb[n] (+ bias[n])) for n in [n0, n1).
static void epi_row_scalar(const void* y, bool in_bf16, float sa, const float* sb, const float* bias, void* out,
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

__attribute__((target("avx512f,avx512bw")))
static void epi_row_avx512(const void* y, bool in_bf16, float sa, const float* sb, const float* bias, void* out,
                           bool out_bf16, int64_t n0, int64_t n1) {
  const __m512 va = _mm512_set1_ps(sa);
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    __m512 v = _mm512_mul_ps(load16(y, n, in_bf16 ? 1 : 0), va);
    v = _mm512_mul_ps(v, _mm512_loadu_ps(sb + n));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
    if (out_bf16) {  // RNE to bf16 in integers (bf16_bits, 16 lanes); NaN stays NaN
      const __m512i u = _mm512_castps_si512(v);
      const __m512i hi = _mm512_srli_epi32(u, 16);
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(hi, one))), 16);
      r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_or_si512(hi, quiet));
      _mm256_storeu_si256((__m256i*)((uint16_t*)out + n), _mm512_cvtepi32_epi16(r));
    } else {
      _mm512_storeu_ps((float*)out + n, v);
    }
  }
  epi_row_scalar(y, in_bf16, sa, sb, bias, out, out_bf16, n, n1);
}

// out[m, n] = round((y[m, n] * sa[m]) * sb[n] (+ bias[n])), all in fp32, rounded once to bf16 (or kept
// fp32): the eager epilogue's expression order. y is the wide GEMM's bf16 or fp32 output; when its
// dtype is the output's, the result is written over it (the caller owns y).
torch::Tensor scale_epilogue(torch::Tensor y, torch::Tensor sa, torch::Tensor sb, torch::Tensor bias,
                             bool has_bias, bool out_bf16) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "y must be a contiguous 2-D tensor");
  TORCH_CHECK(y.scalar_type() == torch::kFloat32 || y.scalar_type() == torch::kBFloat16, "y must be fp32/bf16");
  const int64_t M = y.size(0), N = y.size(1);
  TORCH_CHECK(sa.numel() == M && sb.numel() == N && (!has_bias || bias.numel() == N), "scale sizes");
  const bool in_bf16 = y.scalar_type() == torch::kBFloat16;
  torch::Tensor out = in_bf16 == out_bf16 ? y : torch::empty({M, N}, torch::dtype(out_bf16 ? torch::kBFloat16
                                                                                         : torch::kFloat32));
  const float* sap = sa.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const char* yp = (const char*)y.data_ptr();
  char* op = (char*)out.data_ptr();
  const int64_t ysz = y.element_size(), osz = out.element_size();
  const bool avx = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  // Work items are (row, chunk of up to 4096 columns): rows in parallel, and long rows split too.
  const int64_t C = 4096, chunks = (N + C - 1) / C;
  at::parallel_for(0, M * chunks, std::max<int64_t>(1, 16384 / std::min(N, C)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / chunks, n0 = (i % chunks) * C, n1 = std::min(N, n0 + C);
      if (avx) epi_row_avx512(yp + m * N * ysz, in_bf16, sap[m], sbp, bp, op + m * N * osz, out_bf16, n0, n1);
      else epi_row_scalar(yp + m * N * ysz, in_bf16, sap[m], sbp, bp, op + m * N * osz, out_bf16, n0, n1);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_e4m3_gemm", &fp8_e4m3_gemm);
  m.def("fp8_e4m3_gemm_packed", &fp8_e4m3_gemm_packed);
  m.def("has_bf16_dot", &has_bf16_dot);
  m.def("quant_rows", &quant_rows);
  m.def("scale_epilogue", &scale_epilogue);
}
"""

#: Compiler flags. -fopenmp makes ``at::parallel_for`` run on torch's intra-op threads (without it
#: the loops run on one thread: ATen's OpenMP backend is header-only). -ffp-contract=off: GCC would
#: otherwise fuse ``v * sb + bias`` into one FMA (one rounding instead of two), and the epilogue
#: would no longer be bit-identical to the eager torch one (tests/test_native.py caught it).
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_NAME = "fp8ref_cpu_fp8_" + hashlib.sha256((_SOURCE + " ".join(_CFLAGS)).encode()).hexdigest()[:12]
_lock = threading.Lock()
_module = None
_error: str | None = None


def _built() -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: guard against its removal

        return os.path.exists(os.path.join(_get_build_directory(_NAME, verbose=False), f"{_NAME}.so"))
    except Exception:
        return False


def _cpu_has_bf16_dot() -> bool:
    """avx512_bf16 (with avx512f/bw) on this CPU: asked of the built extension, else of
    /proc/cpuinfo (so that ``supports`` never triggers a build)."""
    global _has_bf16
    if _has_bf16 is None:
        if _module is not None:
            _has_bf16 = bool(_module.has_bf16_dot())
        else:
            return {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_flags()  # not cached: the module may load
    return _has_bf16


_has_bf16: bool | None = None


def pack_weight(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` uint8 codes -> ``(packed, special)``.

    ``packed`` is ``[ceil(N/16), ceil(K/2), 16, 2]``, zero-padded (zero codes add exact zeros): 32
    consecutive bytes are 16 output columns x 2 K-steps, one ``vdpbf16ps`` operand. ``special``
    is ``[ceil(N/16), ceil(K/2)]`` uint8, 1 where those 32 bytes hold a zero or subnormal magnitude
    (the kernel then decodes them with the table lookup; other groups skip it)."""
    N, K = codes.shape
    c = torch.nn.functional.pad(codes, (0, K % 2, 0, (-N) % 16))
    packed = c.view(c.shape[0] // 16, 16, c.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()
    special = ((packed & 0x7F) < 8).view(packed.shape[0], packed.shape[1], 32).any(dim=2).to(torch.uint8)
    return packed, special


def _nan_codes(codes: torch.Tensor) -> bool:
    """E4M3FN's NaN codes (0x7F, 0xFF): the kernel's decoding would read them as 480."""
    return bool(((codes.view(torch.uint8) & 0x7F) == 0x7F).any())


def _toolchain_reason() -> str | None:
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            return "the cpu-fp8 kernel needs ninja to build (pip install ninja)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "the cpu-fp8 kernel needs a C++ compiler (c++ or $CXX)"
    return None


def build(verbose: bool = False):
    """Compile (or load the cached build of) the kernel and return the extension module."""
    global _module, _error
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import load_inline

            try:
                _module = load_inline(_NAME, cpp_sources=[_SOURCE], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                                      verbose=verbose)
            except Exception as exc:  # a failed build makes the backend unavailable, with the reason
                _error = f"building the cpu-fp8 kernel failed: {exc!r}"
                raise RuntimeError(_error) from exc
    return _module


def native():
    """The compiled extension if it is already built (or ``FP8REF_CPU_FP8=1`` asks to build it),
    else None; ``FP8REF_NATIVE=0`` turns it off. Never builds implicitly otherwise.

    Besides the cpu-fp8 GEMM, the extension holds the fused per-row quantizer (``quant_rows``) and
    the scale epilogue (``scale_epilogue``) that ``fast_quantize``, ``cpu-bf16`` and ``cpu-fp32``
    use when it is there: same expressions in the same order as the spec, bit-identical results
    (tests/test_native.py), one pass over the data instead of five or six.
    """
    global _native_state
    if _native_state is not None:
        return _native_state or None
    if os.environ.get("FP8REF_NATIVE", "1").lower() in ("0", "false", "no", "off"):
        return None
    mod = None
    if _error is None and _toolchain_reason() is None and (_module is not None or _built() or _want_build()):
        try:
            mod = build()
        except RuntimeError:
            mod = None
    _native_state = mod if mod is not None else False
    return mod


def reset_native() -> None:
    """Forget ``native()``'s answer (tests switch ``FP8REF_NATIVE`` and call this)."""
    global _native_state
    _native_state = None


_native_state = None


def _want_build() -> bool:
    return os.environ.get("FP8REF_CPU_FP8", "0").lower() in ("1", "true", "yes", "on")


class CpuFp8Backend(Backend):
    """FP8 codes read directly by a C++ kernel (see the module docstring).

    Examples
    --------
    >>> import torch, fp8ref
    >>> be = fp8ref.get_backend("cpu-fp8")
    >>> be.supports(fp8ref.Case(16, 4096, 4096, fp8ref.FP8_BLOCK))
    'cpu-fp8 takes per-row or per-tensor weight scales, not block'
    """

    name = "cpu-fp8"
    accumulation = Accumulation.FP32
    output_roundings = 1
    #: use vdpbf16ps where the CPU has avx512_bf16 (else the fp16-decode + fp32 FMA path)
    bf16_dot = True

    def available(self) -> str | None:
        if _error:
            return _error
        if _module is not None:
            return None
        reason = _toolchain_reason()
        if reason:
            return reason
        if not (_built() or _want_build()):
            return ("the cpu-fp8 C++ kernel is not built yet: run `python -m fp8ref.kernels.cpu_fp8` once "
                    "(about a minute), or set FP8REF_CPU_FP8=1 to build it on first use")
        return None

    @staticmethod
    def _scheme_reason(scheme: QuantScheme, what: str) -> str | None:
        if scheme.format != E4M3FN:
            return f"cpu-fp8 decodes e4m3fn codes only; the {what} scheme is {scheme.format.name}"
        if scheme.granularity not in (Granularity.ROW, Granularity.TENSOR):
            return f"cpu-fp8 takes per-row or per-tensor {what} scales, not {scheme.granularity.value}"
        return None

    def supports(self, case: Case) -> str | None:
        if torch.device(case.device).type != "cpu":
            return f"cpu-fp8 runs on CPU tensors only, the case is on {case.device}"
        scheme_reason = (self._scheme_reason(case.recipe.weight, "weight")
                         or self._scheme_reason(case.recipe.activation, "activation"))
        if scheme_reason:  # what the kernel cannot express at all comes before this CPU's M limit
            return scheme_reason
        packed = self.bf16_dot and _cpu_has_bf16_dot()
        if case.M > (MAX_M if packed else MAX_M_FALLBACK):
            limit = MAX_M if packed else MAX_M_FALLBACK
            how = "" if packed else "without avx512_bf16, "
            return (f"{how}cpu-fp8 is a small-M kernel: M={case.M} > {limit} rows is compute-bound; use cpu-bf16 "
                    "or cpu-fp32")
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        return fast_quantize(x, scheme, scale)

    def prepare_weight(self, w: Quantized) -> PreparedWeight:
        """Check the codes once (no NaN codes) so that ``scaled_mm`` need not re-read the weight."""
        reason = self._scheme_reason(w.scheme, "weight")
        if reason:
            raise ValueError(reason)
        if _nan_codes(w.data):
            raise ValueError("the weight holds NaN codes; cpu-fp8 does not propagate NaN")
        codes = w.data.contiguous().view(torch.uint8)
        return PreparedWeight.wrap(w, self.name, codes=codes, packed=pack_weight(codes) if self._packed() else None)

    def _packed(self) -> bool:
        """Whether the packed avx512_bf16 kernel runs (the CPU has the instructions; ``bf16_dot``)."""
        return self.bf16_dot and _cpu_has_bf16_dot()

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        b, extra = unwrap(b, self.name)
        check_mm_args(a, b, bias, out_dtype)
        for q, what in ((a, "activation"), (b, "weight")):
            reason = self._scheme_reason(q.scheme, what)
            if reason:
                raise ValueError(reason)
        if a.data.device.type != "cpu":
            raise ValueError(f"cpu-fp8 runs on CPU tensors only, got {a.data.device}")
        codes = extra.get("codes")
        if codes is None:
            if _nan_codes(b.data):
                raise ValueError("the weight holds NaN codes; cpu-fp8 does not propagate NaN")
            codes = b.data.contiguous().view(torch.uint8)
        if _nan_codes(a.data):
            raise ValueError("the activations hold NaN codes; cpu-fp8 does not propagate NaN")
        mod = build()
        M, N = a.data.shape[0], b.data.shape[0]
        sa = a.scale.to(torch.float32).reshape(-1).expand(M).contiguous()
        sb = b.scale.to(torch.float32).reshape(-1).expand(N).contiguous()
        b32 = bias_fp32(bias, a.data.device)
        if self._packed():
            packed = extra.get("packed")
            if packed is None:
                packed = pack_weight(codes)
            codes_a = a.data.contiguous().view(torch.uint8)
            bias_arg = (b32 if b32 is not None else sa, b32 is not None)
            ys = [mod.fp8_e4m3_gemm_packed(codes_a[r:r + PACKED_ROWS], *packed, N, sa[r:r + PACKED_ROWS], sb,
                                           *bias_arg) for r in range(0, M, PACKED_ROWS)]
            return (ys[0] if len(ys) == 1 else torch.cat(ys)).to(out_dtype)
        y = mod.fp8_e4m3_gemm(a.data.contiguous().view(torch.uint8), codes, sa, sb,
                              b32 if b32 is not None else sa, b32 is not None)
        return y.to(out_dtype)


register_backend(CpuFp8Backend())


if __name__ == "__main__":
    build(verbose=True)
    print(f"built {_NAME}")
