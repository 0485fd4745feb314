"""The ``cpu-fp8`` backend: a C++ kernel that reads the 1-byte FP8 weights directly (decode / small M).

For a few rows (decode) a linear layer is bound by reading the weight; a bf16 copy of the weight costs two
bytes per element, the FP8 codes one. This kernel streams the ``[N, K]`` E4M3FN codes, decodes 16
at a time (``(c & 0x7F) << 7 | sign << 15`` is the fp16 bit pattern of the value times 2**-8, for
every finite code), and accumulates with fp32 FMAs against the decoded activations. Every product
of two FP8 values is exact in fp32, so each FMA rounds once, like an fp32 addition; the epilogue
``acc * 2**16 * sa * sb + bias`` is fp32 (the 2**16 is exact), and torch rounds the fp32 result once
to ``out_dtype``: ``Accumulation.FP32``, ``output_roundings=1`` (strict class).

The kernel is compiled with ``torch.utils.cpp_extension`` (g++ and ninja) into torch's extension
cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``). Building takes about a
minute on a loaded 2-core machine, so it is never done implicitly by a listing or a selection:
the backend is available once the build exists, and ``python -m fp8ref.kernels.cpu_fp8`` (or
``FP8REF_CPU_FP8=1``, which builds on first use) makes it. Where the CPU has avx512_bf16, the codes
are decoded to bf16 bit patterns (exact) and multiplied with ``vdpbf16ps`` (products exact in
fp32, each addition one fp32 rounding); with AVX-512 and F16C only, the fp16 decoding above and
fp32 FMAs; otherwise a scalar loop.

Declines: other formats than E4M3FN, block/group scales (tensor and row only), more than
``MAX_M`` rows (compute-bound there: slower than ``cpu-bf16``), non-CPU tensors.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading

import torch

from ..bounds import Accumulation
from ..formats import E4M3FN
from ..quant import Quantized
from ..registry import Backend, Case, register_backend
from ..schemes import Granularity, QuantScheme
from ._common import PreparedWeight, bias_fp32, check_mm_args, fast_quantize, unwrap

__all__ = ["CpuFp8Backend", "build", "MAX_M"]

#: Rows beyond which the backend declines. On one core of the (loaded) 2-core EPYC, vdpbf16ps
#: path, two runs: 1.9-5.7x bf16 ``F.linear``'s speed at M = 1, 0.78-1.27x at M = 4, 0.56-0.83x at
#: M = 8, 0.45x at M = 16: beyond a few rows decoding and dot products, not memory, bound it.
MAX_M = 4

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>

// E4M3FN code c -> fp16 bits ((c & 0x7F) << 7 | sign << 15) is the value times 2^-8, exactly, for
// every finite code (normal and subnormal): E4M3's exponent bias is 7, fp16's 15.
static inline float decode_scalar(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float mag = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return std::ldexp((c & 0x80) ? -mag : mag, -8);  // same 2^-8 offset as the vector path
}

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
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  const __m512i sub = _mm512_permutexvar_epi16(mag, table);
  const __mmask32 is_sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i bits = _mm512_mask_blend_epi16(is_sub, normal, sub);
  return _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8));
}

template <int MM>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void rows_bf16_t(const uint16_t* abf, const float* ad, int64_t K, const uint8_t* b, int64_t n0,
                        int64_t n1, float* acc, int64_t ld_acc) {
  const int64_t K32 = K - K % 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* bn = b + n * K;
    __m512 s[MM];
#pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) s[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K32; k += 32) {
      const __m512bh bv = (__m512bh)decode32_bf16(bn + k);
#pragma GCC unroll 16
      for (int m = 0; m < MM; ++m)
        s[m] = _mm512_dpbf16_ps(s[m], (__m512bh)_mm512_loadu_si512((const void*)(abf + m * K + k)), bv);
    }
    for (int m = 0; m < MM; ++m) {
      float t = _mm512_reduce_add_ps(s[m]);
      // tail: same units as the vector part (exact values), so undo the 2^-8 of decode_scalar
      for (int64_t k = K32; k < K; ++k) t = std::fma(ad[m * K + k] * 256.0f, decode_scalar(bn[k]) * 256.0f, t);
      acc[m * ld_acc + (n - n0)] = t;
    }
  }
}

static void rows_bf16(const uint16_t* abf, const float* ad, int64_t M, int64_t K, const uint8_t* b, int64_t n0,
                      int64_t n1, float* acc) {
  const int64_t ld = n1 - n0;
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) rows_bf16_t<8>(abf + m * K, ad + m * K, K, b, n0, n1, acc + m * ld, ld);
  if (m + 4 <= M) { rows_bf16_t<4>(abf + m * K, ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 4; }
  if (m + 2 <= M) { rows_bf16_t<2>(abf + m * K, ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 2; }
  if (m + 1 <= M) { rows_bf16_t<1>(abf + m * K, ad + m * K, K, b, n0, n1, acc + m * ld, ld); m += 1; }
}

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

// out[m, n] = (acc * 2^16) * sa[m] * sb[n] (+ bias[n]), fp32.
torch::Tensor fp8_e4m3_gemm(torch::Tensor a, torch::Tensor b, torch::Tensor sa, torch::Tensor sb,
                            torch::Tensor bias, bool has_bias, bool use_bf16) {
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
  const bool bf16 = use_bf16 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512bf16");
  std::vector<uint16_t> abf(bf16 ? M * K : 0);
  for (int64_t i = 0; i < (int64_t)abf.size(); ++i) {
    float v = ad[i] * 256.0f;  // the exact value; its bf16 bits are its top 16 bits (<= 4 significant bits)
    uint32_t u;
    std::memcpy(&u, &v, 4);
    abf[i] = (uint16_t)(u >> 16);
  }
  const float* sap = sa.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const uint8_t* bcodes = b.data_ptr<uint8_t>();
  // 2^16 undoes the two 2^-8 of the fp16 decoding, exactly; the bf16 path sums exact values.
  const float unscale = bf16 ? 1.0f : 65536.0f;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M * (n1 - n0));
    if (bf16) rows_bf16(abf.data(), ad.data(), M, K, bcodes, n0, n1, acc.data());
    else if (avx) rows_avx512(ad.data(), M, K, bcodes, n0, n1, acc.data());
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fp8_e4m3_gemm", &fp8_e4m3_gemm); }
"""

_NAME = "fp8ref_cpu_fp8_" + hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]
_lock = threading.Lock()
_module = None
_error: str | None = None


def _built() -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: guard against its removal

        return os.path.exists(os.path.join(_get_build_directory(_NAME, verbose=False), f"{_NAME}.so"))
    except Exception:
        return False


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
                _module = load_inline(_NAME, cpp_sources=[_SOURCE], extra_cflags=["-O3"], verbose=verbose)
            except Exception as exc:  # a failed build makes the backend unavailable, with the reason
                _error = f"building the cpu-fp8 kernel failed: {exc!r}"
                raise RuntimeError(_error) from exc
    return _module


def _want_build() -> bool:
    return os.environ.get("FP8REF_CPU_FP8", "0").lower() in ("1", "true", "yes", "on")


class CpuFp8Backend(Backend):
    """FP8 codes read directly by a C++ kernel, for M <= ``MAX_M`` (see the module docstring).

    Examples
    --------
    >>> import torch, fp8ref
    >>> be = fp8ref.get_backend("cpu-fp8")
    >>> be.supports(fp8ref.Case(1024, 4096, 4096, fp8ref.W8A8_FP8))
    'cpu-fp8 is a small-M kernel: M=1024 > 4 rows is compute-bound; use cpu-bf16'
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
        if case.M > MAX_M:
            return f"cpu-fp8 is a small-M kernel: M={case.M} > {MAX_M} rows is compute-bound; use cpu-bf16"
        return (self._scheme_reason(case.recipe.weight, "weight")
                or self._scheme_reason(case.recipe.activation, "activation"))

    def quantize(self, x: torch.Tensor, scheme: QuantScheme) -> Quantized:
        return fast_quantize(x, scheme)

    def prepare_weight(self, w: Quantized) -> PreparedWeight:
        """Check the codes once (no NaN codes) so that ``scaled_mm`` need not re-read the weight."""
        reason = self._scheme_reason(w.scheme, "weight")
        if reason:
            raise ValueError(reason)
        if _nan_codes(w.data):
            raise ValueError("the weight holds NaN codes; cpu-fp8 does not propagate NaN")
        return PreparedWeight.wrap(w, self.name, codes=w.data.contiguous().view(torch.uint8))

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
        y = mod.fp8_e4m3_gemm(a.data.contiguous().view(torch.uint8), codes, sa, sb,
                              b32 if b32 is not None else sa, b32 is not None, self.bf16_dot)
        return y.to(out_dtype)


register_backend(CpuFp8Backend())


if __name__ == "__main__":
    build(verbose=True)
    print(f"built {_NAME}")
