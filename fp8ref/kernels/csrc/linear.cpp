// The warm linear calls of the CPU backends, each one call from Python.
//
// fp8_linear is cpu-fp8's: quant_blocks, the amax check, the GEMM in row chunks and the rounding to
// the output dtype. wide_linear is cpu-bf16's and cpu-fp32's fused path: quant_blocks to the FP8
// values in the wide dtype, the amax check, oneDNN's GEMM (the packed weight's
// mkldnn::_linear_pointwise, or at::linear on a plain one) and scale_epilogue. These are the
// functions CpuFp8Backend.linear and CpuWideBackend.linear call one by one, called here in the
// same order on the same operands, so the bits are the same (tests/test_bound_linear.py compares
// them); what this saves is the dozen Python-level torch calls between them
// (docs/performance.md, "Figures behind the code").
//
// x may have any number of dimensions (its rows are all but the last; the result is [..., N]).
// Where one of the Python path's preconditions does not hold (x not an fp32/bf16/fp16 CPU
// tensor with K columns, an empty operand, a bias that is not a finite [N] fp32/bf16/fp16 CPU
// tensor, a block whose amax is not finite) they return an undefined tensor, None in Python, and
// compute nothing: the caller then runs the backend's linear, which raises or handles the case
// in the spec's words.
#include <cmath>
#include <cstring>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>

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

// Whether x is what the Python paths take on their fused route: an fp32/bf16/fp16 CPU tensor of at
// least one dimension whose last is K, not empty, and N > 0.
bool x_takes(const at::Tensor& x, int64_t N, int64_t K) {
  return x.defined() && x.dim() >= 1 && x.device().is_cpu() && float_dtype(x.scalar_type()) && x.size(-1) == K &&
         x.numel() != 0 && N != 0 && K != 0;
}

// The bias as the Python paths use it (bias_fp32: fp32, contiguous), or false where they would not
// take it on their fused route: not a finite fp32/bf16/fp16 [N] CPU tensor.
bool bias_fp32(const at::Tensor& bias, bool has_bias, int64_t N, at::Tensor& b32) {
  if (!has_bias) return true;
  if (!bias.defined() || bias.dim() != 1 || bias.size(0) != N || !bias.device().is_cpu() ||
      !float_dtype(bias.scalar_type()))
    return false;
  b32 = bias.to(at::kFloat).contiguous();
  return all_finite(b32);
}

// y [M, N] back to x's leading dimensions: [..., N].
at::Tensor unflatten(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  if (x.dim() == 2) return y;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
  sizes.push_back(N);
  return y.reshape(sizes);
}

}  // namespace

// fp8_linear, and with `late` the bound call's: the sample of `late` compared after the quantization
// (its prefetches in flight meanwhile), before the GEMM; a changed byte returns undefined.
static at::Tensor fp8_linear_late(at::Tensor x, bool per_tensor, double qmax, double floor, int64_t mant,
                                  int64_t emin, int64_t ebias, bool negzero, bool pow2, at::Tensor codes,
                                  at::Tensor pb, at::Tensor special, at::Tensor sb, at::Tensor bias, bool has_bias,
                                  int64_t isa, int64_t rows, int64_t out_code, const WeightWatch* late) {
  const CsrGuard csr;  // IEEE subnormals on this thread (the functions called make their own too)
  TORCH_CHECK(out_code >= 0 && out_code <= 2, "fp8_linear: out_code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
  TORCH_CHECK(rows >= 1, "fp8_linear: rows must be >= 1, got ", rows);
  TORCH_CHECK(isa >= -3, "fp8_linear: isa must be -3 (emulated AMX), -2 (AMX), -1 (packed) or a gemm path, got ", isa);
  TORCH_CHECK(codes.defined() && codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.device().is_cpu(),
              "fp8_linear: codes must be contiguous uint8 [N, K] on the CPU");
  const int64_t N = codes.size(0), K = codes.size(1);
  check_fp32_vector(sb, N, "fp8_linear", "sb");
  at::Tensor b32;
  if (!x_takes(x, N, K) || !bias_fp32(bias, has_bias, N, b32)) return at::Tensor();
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});  // rows: every dimension but the last
  const int64_t M = x2.size(0);
  std::vector<at::Tensor> q =
      quant_blocks(x2.contiguous(), per_tensor ? M : 1, K, qmax, floor, mant, emin, ebias, negzero, pow2, 0, -1);
  if (!all_below_inf(q[2]) || (late && !late->same_sample())) return at::Tensor();
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
  return unflatten(y, x, N);
}

at::Tensor fp8_linear(at::Tensor x, bool per_tensor, double qmax, double floor, int64_t mant, int64_t emin,
                      int64_t ebias, bool negzero, bool pow2, at::Tensor codes, at::Tensor pb, at::Tensor special,
                      at::Tensor sb, at::Tensor bias, bool has_bias, int64_t isa, int64_t rows, int64_t out_code) {
  return fp8_linear_late(std::move(x), per_tensor, qmax, floor, mant, emin, ebias, negzero, pow2, std::move(codes),
                         std::move(pb), std::move(special), std::move(sb), std::move(bias), has_bias, isa, rows,
                         out_code, nullptr);
}

const c10::OperatorHandle& packed_linear_op() {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

at::Tensor packed_linear(const at::Tensor& a, const at::Tensor& packed) {
  // mkldnn::_linear_pointwise(a, packed, None, "none", [], ""): CpuWideBackend._packed_linear's call,
  // through the dispatcher (boxed: the op's C++ signature is oneDNN's, not ours to restate).
  const c10::OperatorHandle& op = packed_linear_op();
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(a);
  stack.emplace_back(packed);
  stack.emplace_back(c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// wide_linear, and with `late` the bound call's (as fp8_linear_late).
static at::Tensor wide_linear_late(at::Tensor x, double qmax, double floor, int64_t mant, int64_t emin,
                                   int64_t ebias, bool negzero, at::Tensor weight, bool packed, at::Tensor sb,
                                   at::Tensor bias, bool has_bias, int64_t mode, bool out_bf16,
                                   const WeightWatch* late) {
  const CsrGuard csr;
  TORCH_CHECK(mode == 1 || mode == 2, "wide_linear: mode must be 1 (bf16 values) or 2 (fp32 values), got ", mode);
  const at::ScalarType wide = mode == 1 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(weight.defined() && weight.dim() == 2 && weight.device().is_cpu() && weight.scalar_type() == wide &&
                  (packed ? weight.is_mkldnn() : weight.layout() == at::kStrided),
              "wide_linear: weight must be a [N, K] CPU tensor of the mode's dtype (oneDNN's packed layout when "
              "packed)");
  TORCH_CHECK(mode != 1 || out_bf16, "wide_linear: bf16 values (mode 1) give a bf16 output only");
  const int64_t N = weight.size(0), K = weight.size(1);
  check_fp32_vector(sb, N, "wide_linear", "sb");
  at::Tensor b32;
  if (!x_takes(x, N, K) || !bias_fp32(bias, has_bias, N, b32)) return at::Tensor();
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});
  const int64_t M = x2.size(0);
  std::vector<at::Tensor> q = quant_blocks(x2.contiguous(), 1, K, qmax, floor, mant, emin, ebias, negzero, false,
                                           mode, -1);
  if (!all_below_inf(q[2]) || (late && !late->same_sample())) return at::Tensor();
  const at::Tensor y = packed ? packed_linear(q[0], weight) : at::linear(q[0], weight);
  const at::Tensor sa = q[1].reshape({-1}).expand({M}).contiguous();
  const at::Tensor out = scale_epilogue(y.contiguous(), sa, sb, has_bias ? b32 : sa, has_bias, out_bf16, -1);
  return unflatten(out, x, N);
}

at::Tensor wide_linear(at::Tensor x, double qmax, double floor, int64_t mant, int64_t emin, int64_t ebias,
                       bool negzero, at::Tensor weight, bool packed, at::Tensor sb, at::Tensor bias, bool has_bias,
                       int64_t mode, bool out_bf16) {
  return wide_linear_late(std::move(x), qmax, floor, mant, emin, ebias, negzero, std::move(weight), packed,
                          std::move(sb), std::move(bias), has_bias, mode, out_bf16, nullptr);
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
  const int64_t n = seg_addr.numel();
  for (int64_t i = 0; i < n; ++i) {
    const auto* p = reinterpret_cast<const uint8_t*>(addr[i]);
    if (len[i] == 1 ? *p != *want : std::memcmp(p, want, static_cast<size_t>(len[i])) != 0) return false;
    want += len[i];
  }
  return true;
}

void WeightWatch::prefetch_sample() const {
  // The ranges lie in hundreds of rows that a kernel reading another copy of the weight (cpu-bf16's
  // packed bf16, cpu-fp8's packed codes) has left out of the caches: the bound calls start these
  // loads before quantizing x and compare after it (docs/performance.md, "Figures behind the code").
  const int64_t* addr = seg_addr.const_data_ptr<int64_t>();
  for (int64_t i = 0, n = seg_addr.numel(); i < n; ++i) __builtin_prefetch(reinterpret_cast<const void*>(addr[i]));
}

bool WeightWatch::same_tensors2(const at::Tensor& a, const at::Tensor& b) const {
  return *epoch.const_data_ptr<int64_t>() == epoch_seen && watched.size() == 2 && same_tensor(0, a) &&
         same_tensor(1, b);
}

bool WeightWatch::current(const std::vector<at::Tensor>& now) const {
  if (*epoch.const_data_ptr<int64_t>() != epoch_seen || now.size() != watched.size()) return false;
  for (size_t i = 0; i < now.size(); ++i)
    if (!same_tensor(i, now[i])) return false;
  return same_sample();
}

bool WeightWatch::current2(const at::Tensor& a, const at::Tensor& b) const {
  return same_tensors2(a, b) && same_sample();
}

namespace {

at::ScalarType x_dtype_of(int64_t x_code) {
  TORCH_CHECK(x_code >= 0 && x_code <= 2, "x_code must be 0 (fp32), 1 (bf16) or 2 (fp16), got ", x_code);
  return x_code == 0 ? at::kFloat : (x_code == 1 ? at::kBFloat16 : at::kHalf);
}

}  // namespace

PlanCheck::PlanCheck(int64_t x_code, int64_t K, int64_t m_lo, int64_t m_hi, at::Tensor epoch,
                     std::vector<at::Tensor> watched, std::vector<int64_t> versions, at::Tensor seg_addr,
                     at::Tensor seg_len, at::Tensor expected)
    : x_dtype(x_dtype_of(x_code)), K(K), m_lo(m_lo), m_hi(m_hi),
      watch(std::move(epoch), std::move(watched), std::move(versions), std::move(seg_addr), std::move(seg_len),
            std::move(expected)) {}

bool PlanCheck::admits_but_sample(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                  const at::Tensor& weight, const at::Tensor& scale) const {
  if (!x.defined() || x.scalar_type() != x_dtype || !x.device().is_cpu() || x.dim() < 1 || x.size(-1) != K)
    return false;
  const int64_t M = K ? x.numel() / K : 0;
  if (M < m_lo || M > m_hi) return false;
  if (at::GradMode::is_enabled() && (x.requires_grad() || (bias.has_value() && bias->requires_grad())))
    return false;
  if (!watch.same_tensors2(weight, scale)) return false;
  watch.prefetch_sample();
  return true;
}

BoundLinear::BoundLinear(bool per_tensor, double qmax, double floor, int64_t mant, int64_t emin, int64_t ebias,
                         bool negzero, bool pow2, at::Tensor codes, at::Tensor pb, at::Tensor special, at::Tensor sb,
                         int64_t isa, int64_t rows, int64_t out_code, int64_t x_code, int64_t m_lo,
                         int64_t m_hi, at::Tensor epoch, std::vector<at::Tensor> watched,
                         std::vector<int64_t> versions, at::Tensor seg_addr, at::Tensor seg_len, at::Tensor expected)
    : per_tensor(per_tensor), qmax(qmax), floor(floor), mant(mant), emin(emin), ebias(ebias), negzero(negzero),
      pow2(pow2), codes(std::move(codes)), pb(std::move(pb)), special(std::move(special)), sb(std::move(sb)),
      isa(isa), rows(rows), out_code(out_code),
      check(x_code, this->codes.defined() && this->codes.dim() == 2 ? this->codes.size(1) : -1, m_lo, m_hi,
            std::move(epoch), std::move(watched), std::move(versions), std::move(seg_addr), std::move(seg_len),
            std::move(expected)) {}

bool BoundLinear::current(const std::vector<at::Tensor>& now) const { return check.watch.current(now); }

at::Tensor BoundLinear::call(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& weight,
                             const at::Tensor& scale) const {
  if (!check.admits_but_sample(x, bias, weight, scale)) return at::Tensor();
  if (bias.has_value())
    return fp8_linear_late(x, per_tensor, qmax, floor, mant, emin, ebias, negzero, pow2, codes, pb, special, sb,
                           *bias, true, isa, rows, out_code, &check.watch);
  return fp8_linear_late(x, per_tensor, qmax, floor, mant, emin, ebias, negzero, pow2, codes, pb, special, sb, sb,
                         false, isa, rows, out_code, &check.watch);
}

BoundWideLinear::BoundWideLinear(double qmax, double floor, int64_t mant, int64_t emin, int64_t ebias, bool negzero,
                                 at::Tensor weight, bool packed, at::Tensor sb, int64_t mode, bool out_bf16,
                                 int64_t x_code, int64_t m_lo, int64_t m_hi, at::Tensor epoch,
                                 std::vector<at::Tensor> watched, std::vector<int64_t> versions, at::Tensor seg_addr,
                                 at::Tensor seg_len, at::Tensor expected)
    : qmax(qmax), floor(floor), mant(mant), emin(emin), ebias(ebias), negzero(negzero), weight(std::move(weight)),
      packed(packed), sb(std::move(sb)), mode(mode), out_bf16(out_bf16),
      check(x_code, this->weight.defined() && this->weight.dim() == 2 ? this->weight.size(1) : -1, m_lo, m_hi,
            std::move(epoch), std::move(watched), std::move(versions), std::move(seg_addr), std::move(seg_len),
            std::move(expected)) {
  // the operands' own checks, once (wide_linear repeats them per call: cheap, and it stands alone)
  TORCH_CHECK(this->weight.defined() && this->weight.dim() == 2, "BoundWideLinear: weight must be [N, K]");
  check_fp32_vector(this->sb, this->weight.size(0), "BoundWideLinear", "sb");
  if (this->packed) packed_linear_op();  // the op is looked up here: a torch without it fails to bind
}

at::Tensor BoundWideLinear::call(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                 const at::Tensor& weight_now, const at::Tensor& scale) const {
  if (!check.admits_but_sample(x, bias, weight_now, scale)) return at::Tensor();
  return wide_linear_late(x, qmax, floor, mant, emin, ebias, negzero, weight, packed, sb,
                          bias.has_value() ? *bias : sb, bias.has_value(), mode, out_bf16, &check.watch);
}

}  // namespace fp8ref
