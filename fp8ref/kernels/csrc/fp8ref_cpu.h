// fp8ref's CPU extension: the entry points bound in bindings.cpp (one .cpp file per job) and the
// loads and stores that the quantizer and the epilogue share.
//
// Built by fp8ref/kernels/native.py with torch.utils.cpp_extension.load and the flags
// -O3 -fopenmp -ffp-contract=off. The last one is load-bearing: without it GCC fuses v * s + b
// into one FMA (one rounding instead of two), and the epilogue is no longer bit-identical to the
// eager torch code (tests/test_native.py). Every AVX-512, AVX2 or AMX function carries its own
// target attribute and runs only after a run-time check of the CPU (__builtin_cpu_supports, and for
// AMX the kernel's permission), so one build serves every x86-64 CPU: the scalar loops are the
// fallback.
#pragma once

// The light ATen headers, not ATen/ATen.h: every translation unit compiles in about half the time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace c10 {
class OperatorHandle;  // ATen/core/dispatch/Dispatcher.h (linear.cpp): only linear.cpp calls through it
}  // namespace c10

namespace fp8ref {

// MXCSR without flush-to-zero (bit 15) and denormals-are-zero (bit 6) while the guard lives, on
// the thread that made it: the kernels compute IEEE results whatever the caller set (for
// example torch.set_flush_denormal(True), which sets both), and quant_bf16_avx2 relies on it.
// Every entry point makes one on the calling thread, and every at::parallel_for body its own (a
// worker thread has its own MXCSR; tests/test_fenv.py).
struct CsrGuard {
  unsigned saved;
  CsrGuard() : saved(_mm_getcsr()) {
    if (saved & 0x8040u) _mm_setcsr(saved & ~0x8040u);
  }
  ~CsrGuard() {
    if (saved & 0x8040u) _mm_setcsr(saved);
  }
  CsrGuard(const CsrGuard&) = delete;
  CsrGuard& operator=(const CsrGuard&) = delete;
};

// gemm.cpp: out[m, n] = (acc * 2^16) * sa[m] * sb[n] (+ bias[n]) in fp32, from E4M3FN codes; gemm_isa()
// is its best code path on this CPU (0 scalar, 1 AVX2 + FMA + F16C, 2 AVX-512 + F16C).
int64_t gemm_isa();
at::Tensor fp8_e4m3_gemm(at::Tensor a, at::Tensor b, at::Tensor sa, at::Tensor sb, at::Tensor bias, bool has_bias,
                         int64_t isa);

// gemm_packed.cpp: the same from a weight packed as [N/16, K/2, 16, 2] (avx512_bf16 only);
// has_nan_e4m3: whether contiguous uint8 E4M3FN codes hold a NaN code (any CPU).
bool has_bf16_dot();
bool has_nan_e4m3(at::Tensor codes);
at::Tensor fp8_e4m3_gemm_packed(at::Tensor a, at::Tensor pb, at::Tensor special, int64_t N, at::Tensor sa,
                                at::Tensor sb, at::Tensor bias, bool has_bias);

// gemm_amx.cpp: the same as fp8_e4m3_gemm_packed (no 2^16) on AMX tiles, or on their emulation
// (emulate = true, any CPU). amx_status() is "" where the real tiles can run, else why not (it asks
// the OS for AMX permission the first time); amx_emu_tdpbf16ps runs one emulated instruction.
std::string amx_status();
// out_bf16: the output rounded once to bf16 (as torch's .to would), else fp32.
at::Tensor fp8_e4m3_gemm_amx(at::Tensor a, at::Tensor pb, at::Tensor special, int64_t N, at::Tensor sa,
                             at::Tensor sb, at::Tensor bias, bool has_bias, bool emulate, bool out_bf16);
at::Tensor amx_emu_tdpbf16ps(at::Tensor c, at::Tensor a, at::Tensor b);

// quant.cpp: dynamic quantization with r x c blocks of one scale, bit-identical to
// fp8ref.spec.quant.quantize; cpu_isa() is the best code path this CPU runs (0 scalar, 1 AVX2 + FMA + F16C,
// 2 AVX-512), which every kernel file checks the same way.
int64_t cpu_isa();
std::vector<at::Tensor> quant_blocks(at::Tensor x, int64_t r, int64_t c, double qmax, double floor, int64_t mant,
                                     int64_t emin, int64_t bias, bool negzero, bool pow2, int64_t mode, int64_t isa);

// epilogue.cpp: out = round((y * sa[m]) * sb[n] (+ bias[n])), the eager epilogue's order; isa as quant_blocks.
at::Tensor scale_epilogue(at::Tensor y, at::Tensor sa, at::Tensor sb, at::Tensor bias, bool has_bias,
                          bool out_bf16, int64_t isa);

// linear.cpp: cpu-fp8's warm linear in one call (quant_blocks, the amax check, the GEMM, the output
// rounding); undefined (None) where the Python steps must take the call. isa -1: the packed kernel,
// -2: the AMX kernel, -3: the AMX kernel on emulated tiles (pb, special; `rows` rows per call),
// >= 0: fp8_e4m3_gemm's path. out_code: 0 fp32, 1 bf16, 2 fp16.
at::Tensor fp8_linear(at::Tensor x, bool per_tensor, double qmax, double floor, int64_t mant, int64_t emin,
                      int64_t ebias, bool negzero, bool pow2, at::Tensor codes, at::Tensor pb, at::Tensor special,
                      at::Tensor sb, at::Tensor bias, bool has_bias, int64_t isa, int64_t rows, int64_t out_code);

// linear.cpp: what a plan holds for, checked in one call (fp8ref.weightcheck.Watch): current(...)
// is true while epoch holds the value it held at construction (the backend bumps it when its kernel
// settings change; a counter nobody bumps for a backend that has none), the tensors passed have the
// storage pointer, version, sizes and strides of the watched tensors at construction, and every
// sampled byte range (seg_addr, seg_len: addresses inside the watched tensors, which this object
// keeps alive; checked at construction) holds the bytes of `expected`.
struct WeightWatch {
  at::Tensor epoch;
  int64_t epoch_seen = 0;
  std::vector<at::Tensor> watched;
  std::vector<int64_t> versions;
  std::vector<const void*> ptrs;
  std::vector<std::vector<int64_t>> sizes, strides;
  at::Tensor seg_addr, seg_len, expected;

  WeightWatch(at::Tensor epoch, std::vector<at::Tensor> watched, std::vector<int64_t> versions, at::Tensor seg_addr,
              at::Tensor seg_len, at::Tensor expected);
  bool same_tensor(size_t i, const at::Tensor& t) const;
  bool same_tensors2(const at::Tensor& a, const at::Tensor& b) const;  // epoch and two tensors, no sample
  void prefetch_sample() const;  // starts the sample's loads (no check)
  bool same_sample() const;
  bool current(const std::vector<at::Tensor>& now) const;
  bool current2(const at::Tensor& a, const at::Tensor& b) const;  // two watched tensors (codes, scales)
};

// linear.cpp: what every bound call checks before it computes (fp8ref.api.plans, the backends'
// bind_watched_linear): x has x_dtype (x_code: 0 fp32, 1 bf16, 2 fp16), is on the CPU with K
// columns and m_lo <= rows <= m_hi; no gradient is wanted (grad mode and an input that requires
// grad); and the watch (epoch, weight, scale, sample) is current.
struct PlanCheck {
  at::ScalarType x_dtype;
  int64_t K, m_lo, m_hi;
  WeightWatch watch;

  PlanCheck(int64_t x_code, int64_t K, int64_t m_lo, int64_t m_hi, at::Tensor epoch, std::vector<at::Tensor> watched,
            std::vector<int64_t> versions, at::Tensor seg_addr, at::Tensor seg_len, at::Tensor expected);
  // Everything but the sample's bytes, whose loads it starts: the bound call compares them
  // (watch.same_sample()) after quantizing x, before the GEMM, and computes nothing if one changed.
  bool admits_but_sample(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& weight,
                         const at::Tensor& scale) const;
};

// linear.cpp: cpu-fp8's plan's warm call with its checks in one call from Python
// (CpuFp8Backend.bind_watched_linear). call(x, bias, weight, scale) runs fp8_linear with the fixed
// arguments where `check` admits the call, else returns undefined (None) and computes nothing.
struct BoundLinear {
  bool per_tensor;
  double qmax, floor;
  int64_t mant, emin, ebias;
  bool negzero, pow2;
  at::Tensor codes, pb, special, sb;
  int64_t isa, rows, out_code;
  PlanCheck check;

  BoundLinear(bool per_tensor, double qmax, double floor, int64_t mant, int64_t emin, int64_t ebias, bool negzero,
              bool pow2, at::Tensor codes, at::Tensor pb, at::Tensor special, at::Tensor sb, int64_t isa, int64_t rows,
              int64_t out_code, int64_t x_code, int64_t m_lo, int64_t m_hi, at::Tensor epoch,
              std::vector<at::Tensor> watched, std::vector<int64_t> versions, at::Tensor seg_addr, at::Tensor seg_len,
              at::Tensor expected);
  bool current(const std::vector<at::Tensor>& now) const;
  at::Tensor call(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& weight,
                  const at::Tensor& scale) const;
};

// linear.cpp: cpu-bf16's and cpu-fp32's fused linear in one call (quant_blocks to the FP8 values in
// the wide dtype, the amax check, oneDNN's GEMM, scale_epilogue); undefined (None) where the Python
// steps must take the call. mode: 1 bf16 values (bf16 output only), 2 fp32 values; weight: the
// prepared wide [N, K], in oneDNN's packed layout when `packed`; sb: the weight's fp32 scales [N].
const c10::OperatorHandle& packed_linear_op();
at::Tensor wide_linear(at::Tensor x, double qmax, double floor, int64_t mant, int64_t emin, int64_t ebias,
                       bool negzero, at::Tensor weight, bool packed, at::Tensor sb, at::Tensor bias, bool has_bias,
                       int64_t mode, bool out_bf16);

// linear.cpp: wide_linear with the plan's checks (CpuWideBackend.bind_watched_linear), as BoundLinear.
struct BoundWideLinear {
  double qmax, floor;
  int64_t mant, emin, ebias;
  bool negzero;
  at::Tensor weight;
  bool packed;
  at::Tensor sb;
  int64_t mode;
  bool out_bf16;
  PlanCheck check;

  BoundWideLinear(double qmax, double floor, int64_t mant, int64_t emin, int64_t ebias, bool negzero,
                  at::Tensor weight, bool packed, at::Tensor sb, int64_t mode, bool out_bf16, int64_t x_code,
                  int64_t m_lo, int64_t m_hi, at::Tensor epoch, std::vector<at::Tensor> watched,
                  std::vector<int64_t> versions, at::Tensor seg_addr, at::Tensor seg_len, at::Tensor expected);
  at::Tensor call(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& weight,
                  const at::Tensor& scale) const;
};

// The GEMMs' epilogue operands: sa [M] and sb [N] fp32, bias [N] fp32 when has_bias, contiguous.
static inline void check_epilogue_args(const at::Tensor& sa, const at::Tensor& sb, const at::Tensor& bias,
                                       bool has_bias, int64_t M, int64_t N) {
  TORCH_CHECK(sa.device().is_cpu() && sb.device().is_cpu() && (!has_bias || bias.device().is_cpu()),
              "sa, sb and bias must be CPU tensors");
  TORCH_CHECK(sa.scalar_type() == at::kFloat && sa.is_contiguous() && sa.numel() == M, "sa must be fp32 [M]");
  TORCH_CHECK(sb.scalar_type() == at::kFloat && sb.is_contiguous() && sb.numel() == N, "sb must be fp32 [N]");
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N),
              "bias must be fp32 [N]");
}

// The entry points' operands are read through raw pointers: each must be a CPU tensor.
static inline void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor, got one on ", t.device());
}

// Element i of a row of fp32 (t = 0), bf16 (t = 1) or fp16 (t = 2), widened exactly to fp32.
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

// Elements i .. i + 15 of the same, widened exactly to fp32.
__attribute__((target("avx512f,avx512bw"))) static inline __m512 load16(const void* p, int64_t i, int t) {
  if (t == 0) return _mm512_loadu_ps((const float*)p + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
  if (t == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// Elements i .. i + 7 of the same, widened exactly to fp32 (AVX2 + F16C).
__attribute__((target("avx2,f16c"))) static inline __m256 load8(const void* p, int64_t i, int t) {
  if (t == 0) return _mm256_loadu_ps((const float*)p + i);
  const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
  if (t == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

// The bf16 bits of f, rounded to nearest even; NaN stays NaN (c10::BFloat16's rounding).
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// bf16_bits on 16 lanes (AVX-512): the bf16 bits of v, rounded to nearest even in integers; NaN
// stays NaN.
__attribute__((target("avx512f,avx512bw"))) static inline __m256i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(hi, _mm512_set1_epi32(1)))), 16);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r,
                                                       _mm512_or_si512(hi, _mm512_set1_epi32(0x40))));
}

// Guard of an entry point: `t` is a contiguous fp32 CPU tensor of n elements (a scale or bias vector
// that the kernel indexes 0..n-1). Every function bound in bindings.cpp checks what it indexes at its
// top, so a bad argument raises RuntimeError instead of reading out of bounds (tests/test_native.py::test_entry_points_guard_their_operands).
static inline void check_fp32_vector(const at::Tensor& t, int64_t n, const char* fn, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, fn,
              ": ", what, " must be a contiguous fp32 CPU tensor of ", n, " elements, got ", t.scalar_type(),
              " of shape ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)", " on ", t.device());
}

}  // namespace fp8ref
