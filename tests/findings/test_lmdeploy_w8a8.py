"""LMDeploy 0.18.0's SmoothQuant W8A8 path with FP8 (``lmdeploy lite smooth_quant --quant-dtype fp8``,
served by ``TritonLinearW8A8Impl``). Standalone reproductions, no fp8ref; each fails today (strict
xfail on the assertion). ``python tests/findings/test_lmdeploy_w8a8.py`` runs them and exits 1.

* ``per_channel_quant`` (``lmdeploy/pytorch/kernels/default/w8a8_kernels.py``, the offline weight
  quantizer ``QLinear.from_float`` runs) computes ``s = amax / 448`` with no floor: an all-zero output
  channel gets scale 0 and ``0 / 0`` = NaN codes, written into the checkpoint.
* ``matmul_kernel_dynamic_quant`` (``.../kernels/cuda/w8a8_triton_kernels.py``) stores
  ``acc * s_a * s_w`` in the output dtype and adds the bias afterwards (``c += bias``): two roundings,
  as SGLang's ``triton_scaled_mm`` (test_sglang_scaled_mm_bias.py). Runs the kernel in Triton's CPU
  interpreter with an fp16 output (whose interpreter arithmetic is IEEE); the autotuner, which cannot
  time configurations there, is given equal times (the first configuration runs).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("lmdeploy")


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="lmdeploy-smooth-quant-zero-channel-nan: fixed in a later revision of w8a8_kernels.py")
def test_all_zero_output_channel_quantizes_to_zero_codes():
    from lmdeploy.pytorch.kernels.default.w8a8_kernels import per_channel_quant

    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    w[1] = 0  # a pruned output channel
    q, s = per_channel_quant(w, torch.float8_e4m3fn)
    codes = q.float()
    assert not bool(torch.isnan(codes).any()), (f"{int(torch.isnan(codes).sum())} NaN codes; the zero channel's scale "
                                               f"is {s[1].item()!r}")


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="lmdeploy-w8a8-bias-rounding: no upstream report found")
def test_bias_is_added_before_the_output_rounding():
    pytest.importorskip("triton")
    from lmdeploy.pytorch.kernels.cuda import w8a8_triton_kernels as mod

    mod._linear.__dict__["do_bench"] = lambda kernel_call, quantiles: [1.0, 1.0, 1.0]
    a = torch.zeros(16, 16)
    a[0, 0] = 1.0
    w = torch.zeros(16, 16)  # [N, K]
    w[0, 0] = 1.0
    scale_a = torch.ones(16)
    scale_w = torch.full((16,), 1 + 2.0**-11)  # acc * scales: 1 + 2**-11, a tie in fp16 (rounds to 1)
    bias = torch.full((16,), 2.0**-12, dtype=torch.float16)
    y = mod.matmul_kernel_dynamic_quant(a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), scale_a, scale_w,
                                        bias=bias, output_dtype=torch.float16)
    exact = 1 + 2.0**-11 + 2.0**-12  # 1.000732..., nearest fp16: 1 + 2**-10
    once = torch.tensor(exact, dtype=torch.float64).to(torch.float16)
    assert y[0, 0].item() == once.item(), f"got {y[0, 0].item()!r}, correctly rounded {once.item()!r}"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
