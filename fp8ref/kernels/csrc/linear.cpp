// cpu-fp8's warm linear in one call from Python: quant_blocks, the amax check, the GEMM in row
// chunks and the rounding to the output dtype. These are the functions CpuFp8Backend.linear calls
// one by one, called here in the same order on the same operands, so the bits are the same
// (tests/test_bound_linear.py compares them); what this saves is the dozen Python-level torch
// calls between them (docs/performance.md, "Figures behind the code").
//
// x may have any number of dimensions (its rows are all but the last; the result is [..., N]).
// Where one of the Python path's preconditions does not hold (x not an fp32/bf16/fp16 CPU
// tensor with K columns, an empty operand, a bias that is not a finite [N] fp32/bf16/fp16 CPU
// tensor, a block whose amax is not finite) it returns an undefined tensor, None in Python, and
// computes nothing: the caller then runs CpuFp8Backend.linear, which raises or handles the case
// in the spec's words.
#include <cmath>
#include <cstring>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>

#include "fp8ref_cpu.h"

namespace fp8ref {

namespace {

bool float_dtype(at::ScalarType st) { return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf; }

bool all_below_inf(const at::Tensor& t) {  // false for +-inf and NaN (a NaN compares false)
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i)
    if (!(p[i] < INFINITY)) return false;
  return true;
}

bool all_finite(const at::Tensor& t) {
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i)
    if (!std::isfinite(p[i])) return false;
  return true;
}

}  // namespace

at::Tensor fp8_linear(at::Tensor x, bool per_tensor, double qmax, double floor, int64_t mant, int64_t emin,
                      int64_t ebias, bool negzero, bool pow2, at::Tensor codes, at::Tensor pb, at::Tensor special,
                      at::Tensor sb, at::Tensor bias, bool has_bias, int64_t isa, int64_t rows, int64_t out_code) {
  const CsrGuard csr;  // IEEE subnormals on this thread (the functions called make their own too)
  TORCH_CHECK(out_code >= 0 && out_code <= 2, "fp8_linear: out_code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
  TORCH_CHECK(rows >= 1, "fp8_linear: rows must be >= 1, got ", rows);
  TORCH_CHECK(isa >= -3, "fp8_linear: isa must be -3 (emulated AMX), -2 (AMX), -1 (packed) or a gemm path, got ", isa);
  TORCH_CHECK(codes.defined() && codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.device().is_cpu(),
              "fp8_linear: codes must be contiguous uint8 [N, K] on the CPU");
  const int64_t N = codes.size(0), K = codes.size(1);
  check_fp32_vector(sb, N, "fp8_linear", "sb");
  if (!x.defined() || x.dim() < 1 || !x.device().is_cpu() || !float_dtype(x.scalar_type()) || x.size(-1) != K ||
      x.numel() == 0 || N == 0 || K == 0)
    return at::Tensor();
  at::Tensor b32;
  if (has_bias) {
    if (!bias.defined()) return at::Tensor();
    if (bias.dim() != 1 || bias.size(0) != N || !bias.device().is_cpu() || !float_dtype(bias.scalar_type()))
      return at::Tensor();
    b32 = bias.to(at::kFloat).contiguous();
    if (!all_finite(b32)) return at::Tensor();
  }
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});  // rows: every dimension but the last
  const int64_t M = x2.size(0);
  std::vector<at::Tensor> q =
      quant_blocks(x2.contiguous(), per_tensor ? M : 1, K, qmax, floor, mant, emin, ebias, negzero, pow2, 0, -1);
  if (!all_below_inf(q[2])) return at::Tensor();
  const at::Tensor a = q[0];
  const at::Tensor sa = q[1].reshape({-1}).expand({M}).contiguous();
  const at::Tensor bias_arg = has_bias ? b32 : sa;  // as the Python path: an unread placeholder
  at::Tensor y;
  const at::ScalarType out = out_code == 0 ? at::kFloat : (out_code == 1 ? at::kBFloat16 : at::kHalf);
  if (isa <= -2) {  // the AMX kernel (-2: the tiles, -3: their emulation), `rows` rows per call
    const bool emulate = isa == -3, out_bf16 = out == at::kBFloat16;
    if (M <= rows) {
      y = fp8_e4m3_gemm_amx(a, pb, special, N, sa, sb, bias_arg, has_bias, emulate, out_bf16);
    } else {
      std::vector<at::Tensor> parts;
      for (int64_t r = 0; r < M; r += rows) {
        const int64_t n = std::min(rows, M - r);
        parts.push_back(fp8_e4m3_gemm_amx(a.narrow(0, r, n), pb, special, N, sa.narrow(0, r, n), sb, bias_arg,
                                          has_bias, emulate, out_bf16));
      }
      y = at::cat(parts);
    }
  } else if (isa == -1) {  // the packed avx512_bf16 kernel, `rows` activation rows per call
    if (M <= rows) {
      y = fp8_e4m3_gemm_packed(a, pb, special, N, sa, sb, bias_arg, has_bias);
    } else {
      std::vector<at::Tensor> parts;
      for (int64_t r = 0; r < M; r += rows) {
        const int64_t n = std::min(rows, M - r);
        parts.push_back(fp8_e4m3_gemm_packed(a.narrow(0, r, n), pb, special, N, sa.narrow(0, r, n), sb, bias_arg,
                                             has_bias));
      }
      y = at::cat(parts);
    }
  } else {
    y = fp8_e4m3_gemm(a, codes, sa, sb, bias_arg, has_bias, isa);
  }
  if (y.scalar_type() != out) y = y.to(out);
  if (x.dim() == 2) return y;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
  sizes.push_back(N);
  return y.reshape(sizes);
}

}  // namespace fp8ref

namespace fp8ref {

namespace {

int64_t version_of(const at::Tensor& t) {  // -1 for an inference tensor (no version counter), as in Python
  return t.is_inference() ? -1 : static_cast<int64_t>(t._version());
}

}  // namespace

WeightWatch::WeightWatch(at::Tensor epoch, std::vector<at::Tensor> watched, std::vector<int64_t> versions,
                         at::Tensor seg_addr, at::Tensor seg_len, at::Tensor expected)
    : epoch(std::move(epoch)), watched(std::move(watched)), versions(std::move(versions)),
      seg_addr(std::move(seg_addr)), seg_len(std::move(seg_len)), expected(std::move(expected)) {
  TORCH_CHECK(this->epoch.defined() && this->epoch.scalar_type() == at::kLong && this->epoch.numel() == 1 &&
                  this->epoch.device().is_cpu() && this->epoch.is_contiguous(),
              "WeightWatch: epoch must be a CPU int64 tensor of one element");
  epoch_seen = *this->epoch.const_data_ptr<int64_t>();
  TORCH_CHECK(this->versions.size() == this->watched.size(), "WeightWatch: one version per watched tensor");
  for (const at::Tensor& t : this->watched) {
    TORCH_CHECK(t.defined() && t.device().is_cpu(), "WeightWatch: watched tensors must be CPU tensors");
    ptrs.push_back(t.const_data_ptr());
    sizes.emplace_back(t.sizes().begin(), t.sizes().end());
    strides.emplace_back(t.strides().begin(), t.strides().end());
  }
  TORCH_CHECK(this->seg_addr.scalar_type() == at::kLong && this->seg_len.scalar_type() == at::kLong &&
                  this->seg_addr.dim() == 1 && this->seg_len.dim() == 1 &&
                  this->seg_addr.numel() == this->seg_len.numel() && this->seg_addr.is_contiguous() &&
                  this->seg_len.is_contiguous() && this->seg_addr.device().is_cpu() && this->seg_len.device().is_cpu(),
              "WeightWatch: seg_addr and seg_len must be contiguous CPU int64 [S]");
  TORCH_CHECK(this->expected.scalar_type() == at::kByte && this->expected.is_contiguous() &&
                  this->expected.device().is_cpu() && this->expected.dim() == 1 &&
                  this->expected.numel() == this->seg_len.sum().item<int64_t>(),
              "WeightWatch: expected must be contiguous CPU uint8 holding every segment's bytes");
  // every range lies in the storage of a watched tensor (kept alive here): never a read elsewhere
  const int64_t* addr = this->seg_addr.const_data_ptr<int64_t>();
  const int64_t* len = this->seg_len.const_data_ptr<int64_t>();
  for (int64_t i = 0, n = this->seg_addr.numel(); i < n; ++i) {
    bool inside = false;
    for (const at::Tensor& t : this->watched) {
      const auto lo = reinterpret_cast<uintptr_t>(t.storage().data());
      const auto hi = lo + t.storage().nbytes();
      const auto a = static_cast<uintptr_t>(addr[i]);
      if (len[i] >= 0 && a >= lo && a <= hi && static_cast<uintptr_t>(len[i]) <= hi - a) inside = true;
    }
    TORCH_CHECK(inside, "WeightWatch: byte range ", i, " lies outside the watched tensors' storage");
  }
}

bool WeightWatch::same_tensor(size_t i, const at::Tensor& t) const {
  return t.defined() && t.const_data_ptr() == ptrs[i] && version_of(t) == versions[i] && t.sizes() == sizes[i] &&
         t.strides() == strides[i];
}

bool WeightWatch::same_sample() const {
  // The sample reads the memory of the tensors kept at binding (alive while this object is): the
  // same storage as the caller's, since the pointers matched while the kept ones hold theirs.
  const int64_t* addr = seg_addr.const_data_ptr<int64_t>();
  const int64_t* len = seg_len.const_data_ptr<int64_t>();
  const uint8_t* want = expected.const_data_ptr<uint8_t>();
  for (int64_t i = 0, n = seg_addr.numel(); i < n; ++i) {
    if (std::memcmp(reinterpret_cast<const void*>(addr[i]), want, static_cast<size_t>(len[i])) != 0) return false;
    want += len[i];
  }
  return true;
}

bool WeightWatch::current(const std::vector<at::Tensor>& now) const {
  if (*epoch.const_data_ptr<int64_t>() != epoch_seen || now.size() != watched.size()) return false;
  for (size_t i = 0; i < now.size(); ++i)
    if (!same_tensor(i, now[i])) return false;
  return same_sample();
}

bool WeightWatch::current2(const at::Tensor& a, const at::Tensor& b) const {
  if (*epoch.const_data_ptr<int64_t>() != epoch_seen || watched.size() != 2) return false;
  return same_tensor(0, a) && same_tensor(1, b) && same_sample();
}

BoundLinear::BoundLinear(bool per_tensor, double qmax, double floor, int64_t mant, int64_t emin, int64_t ebias,
                         bool negzero, bool pow2, at::Tensor codes, at::Tensor pb, at::Tensor special, at::Tensor sb,
                         int64_t isa, int64_t rows, int64_t out_code, int64_t x_code, int64_t m_lo,
                         int64_t m_hi, at::Tensor epoch, std::vector<at::Tensor> watched,
                         std::vector<int64_t> versions, at::Tensor seg_addr, at::Tensor seg_len, at::Tensor expected)
    : per_tensor(per_tensor), qmax(qmax), floor(floor), mant(mant), emin(emin), ebias(ebias), negzero(negzero),
      pow2(pow2), codes(std::move(codes)), pb(std::move(pb)), special(std::move(special)), sb(std::move(sb)),
      isa(isa), rows(rows), out_code(out_code),
      x_dtype(x_code == 0 ? at::kFloat : (x_code == 1 ? at::kBFloat16 : at::kHalf)), m_lo(m_lo), m_hi(m_hi),
      watch(std::move(epoch), std::move(watched), std::move(versions), std::move(seg_addr), std::move(seg_len),
            std::move(expected)) {}

bool BoundLinear::current(const std::vector<at::Tensor>& now) const { return watch.current(now); }

at::Tensor BoundLinear::call(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& weight,
                             const at::Tensor& scale) const {
  if (!x.defined() || x.scalar_type() != x_dtype || !x.device().is_cpu() || x.dim() < 1 ||
      x.size(-1) != codes.size(1))
    return at::Tensor();
  const int64_t K = codes.size(1), M = K ? x.numel() / K : 0;
  if (M < m_lo || M > m_hi) return at::Tensor();
  if (at::GradMode::is_enabled() && (x.requires_grad() || (bias.has_value() && bias->requires_grad())))
    return at::Tensor();
  if (!watch.current2(weight, scale)) return at::Tensor();
  if (bias.has_value())
    return fp8_linear(x, per_tensor, qmax, floor, mant, emin, ebias, negzero, pow2, codes, pb, special, sb, *bias,
                      true, isa, rows, out_code);
  return fp8_linear(x, per_tensor, qmax, floor, mant, emin, ebias, negzero, pow2, codes, pb, special, sb, sb, false,
                    isa, rows, out_code);
}

}  // namespace fp8ref
