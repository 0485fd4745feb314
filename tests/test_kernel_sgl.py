"""The sgl-kernel adapters' layout conversions, checked on CPU.

No sgl-kernel kernel runs here: the argument tensors the adapters build are fed to a float64
*emulation* of what each kernel is documented to compute, and that is compared with the spec.
This tests the layouts (transposes, strides, padding, scale shapes, bias handling), not the
kernels; the kernels are checked by tests/test_kernels.py on a CUDA machine with sgl-kernel.
"""

import pytest
import torch

from fp8ref.kernels import sgl
from fp8ref.spec import bounds, gemm, quant
from fp8ref.spec.schemes import FP8_BLOCK, FP8_PER_TENSOR, W8A8_FP8


def _emulate_fp8_scaled_mm(mat_a, mat_b, scales_a, scales_b, out_dtype, bias=None):
    """out[m, n] = sa[m] sb[n] sum_k a[m, k] b[k, n] (+ bias[n]), in float64 (emulation only)."""
    assert mat_a.dim() == 2 and mat_b.dim() == 2 and mat_a.shape[1] == mat_b.shape[0]
    assert mat_a.stride(1) == 1, "mat_a must be row-major"
    assert mat_b.stride(0) == 1, "mat_b must be column-major"
    assert mat_a.shape[1] % 16 == 0 and mat_b.shape[1] % 16 == 0, "K and N must be 16-aligned"
    assert scales_a.shape == (mat_a.shape[0],) and scales_b.shape == (mat_b.shape[1],)
    assert scales_a.dtype == scales_b.dtype == torch.float32
    y = (mat_a.double() @ mat_b.double()) * scales_a.double()[:, None] * scales_b.double()[None, :]
    if bias is not None:
        assert bias.dtype == out_dtype and bias.shape == (mat_b.shape[1],)
        y = y + bias.double()
    return y


def _emulate_blockwise(mat_a, mat_b, scales_a, scales_b, out_dtype):
    M, K = mat_a.shape
    N = mat_b.shape[1]
    assert mat_b.stride(0) == 1 and scales_a.stride(0) == 1, "mat_b column-major, scales_a M-major"
    assert scales_a.shape == (M, K // 128) and scales_b.shape == (K // 128, N // 128)
    y = torch.zeros(M, N, dtype=torch.float64)
    for j in range(K // 128):
        part = mat_a[:, j * 128:(j + 1) * 128].double() @ mat_b[j * 128:(j + 1) * 128].double()
        sb = scales_b[j].double().repeat_interleave(128)
        y += part * scales_a[:, j].double()[:, None] * sb[None, :]
    return y


def _check(y64, a, b, bias):
    y_ref, _ = gemm.scaled_mm_exact(a, b, bias)
    bound = bounds.gemm_error_bound(a, b, bias, out_dtype=torch.float64, accumulation=bounds.Accumulation.FP32)
    assert bool(((y64 - y_ref).abs() <= bound).all())


@pytest.mark.parametrize("M,N,K,recipe", [(4, 32, 64, W8A8_FP8), (3, 10, 20, W8A8_FP8), (5, 17, 48, FP8_PER_TENSOR)])
def test_scaled_mm_args_describe_the_spec_product(M, N, K, recipe):
    a = quant.quantize(torch.randn(M, K), recipe.activation)
    b = quant.quantize(torch.randn(N, K), recipe.weight)
    bias = torch.randn(N).to(torch.bfloat16)  # exactly representable in bf16: fused
    kwargs, late, n = sgl.scaled_mm_args(a, b, bias, torch.bfloat16)
    assert late is None and n == N
    y = _emulate_fp8_scaled_mm(**kwargs)[:, :N]
    _check(y, a, b, bias)
    if kwargs["mat_b"].shape[1] != N:  # padded columns are zero codes
        assert not kwargs["mat_b"][:, N:].float().any()


def test_scaled_mm_args_keep_an_inexact_bias_out_of_the_kernel():
    a = quant.quantize(torch.randn(2, 32))
    b = quant.quantize(torch.randn(16, 32))
    bias = torch.full((16,), 1.0 + 2.0**-12)  # not a bf16 value
    kwargs, late, _ = sgl.scaled_mm_args(a, b, bias, torch.bfloat16)
    assert kwargs["bias"] is None and late.dtype == torch.float32
    _check(_emulate_fp8_scaled_mm(**kwargs) + late.double(), a, b, bias)


def test_scaled_mm_args_refuse_fp32_output():
    a, b = quant.quantize(torch.randn(2, 32)), quant.quantize(torch.randn(16, 32))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        sgl.scaled_mm_args(a, b, out_dtype=torch.float32)


def test_blockwise_args_describe_the_spec_product():
    a = quant.quantize(torch.randn(5, 384), FP8_BLOCK.activation)
    b = quant.quantize(torch.randn(256, 384), FP8_BLOCK.weight)
    _check(_emulate_blockwise(**sgl.blockwise_mm_args(a, b)), a, b, None)


def test_blockwise_args_refuse_unaligned_shapes():
    a = quant.quantize(torch.randn(5, 200), FP8_BLOCK.activation)
    b = quant.quantize(torch.randn(128, 200), FP8_BLOCK.weight)
    with pytest.raises(ValueError, match="multiples of 128"):
        sgl.blockwise_mm_args(a, b)


def test_quant_buffers():
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    buf = sgl.per_token_quant_buffers(x)
    assert buf["output_q"].dtype == torch.float8_e4m3fn and buf["output_s"].shape == (6, 1)
    buf = sgl.group_quant_buffers(x, 128)
    assert buf["output_s"].shape == (6, 2) and buf["output_s"].dtype == torch.float32
    with pytest.raises(ValueError, match="group_size"):
        sgl.group_quant_buffers(torch.randn(2, 200), 128)


class _FakePerTokenKernel:
    """A stand-in with the *documented* behaviour of sgl_per_token_quant_fp8 (no amax floor, so an
    all-zero row gets scale 0 and NaN codes), to test the adapter's repair of such rows."""

    @staticmethod
    def sgl_per_token_quant_fp8(x, q, s):
        amax = x.float().abs().amax(dim=1, keepdim=True)
        s.copy_(amax / 448.0)
        q.copy_((x.float() * (1.0 / s)).clamp(-448, 448).to(q.dtype))


def test_adapter_repairs_rows_without_floor(monkeypatch):
    monkeypatch.setattr(sgl, "_module", _FakePerTokenKernel())
    x = torch.randn(4, 64)
    x[1] = 0
    q = sgl.SglKernelBackend().quantize(x, W8A8_FP8.activation)
    ref = quant.quantize(x, W8A8_FP8.activation)
    assert torch.equal(q.scale[1], ref.scale[1]) and not q.data[1].float().any()
    assert bool((q.scale > 0).all())


def test_unavailable_reason_names_the_cause():
    reason = sgl.SglKernelBackend().available()
    if reason is None:
        pytest.skip("sgl-kernel is available here")
    assert "CUDA" in reason or "sgl_kernel" in reason
