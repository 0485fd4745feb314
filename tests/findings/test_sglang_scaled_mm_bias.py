"""SGLang 0.5.23 ``triton_scaled_mm`` (the Triton W8A8 GEMM SGLang falls back to when sgl-kernel's
CUTLASS GEMM does not take a shape) rounds ``acc * scale_a * scale_b`` to the output dtype and only
then adds the bias: two roundings. vLLM's copy of the same kernel adds the bias to the fp32
accumulator first ("Add bias in accumulator dtype for less rounding error"). Standalone
reproduction, no fp8ref; runs the kernel in Triton's CPU interpreter with fp16 output (whose
interpreter arithmetic is IEEE). Fails today (strict xfail).
``python tests/findings/test_sglang_scaled_mm_bias.py`` runs it and exits 1.
"""

import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("sglang")
pytest.importorskip("triton")


def _sglang_gemm_module():
    # The GEMM module imports deep_gemm_wrapper, whose import chain needs torchvision; DeepGEMM is
    # CUDA-only and unused here, so a stand-in module is enough.
    name = "sglang.srt.layers.deep_gemm_wrapper"
    try:
        __import__(name)
    except Exception:
        sys.modules[name] = types.SimpleNamespace(ENABLE_JIT_DEEPGEMM=False)
    from sglang.kernels.ops.gemm import fp8_kernel

    return fp8_kernel


@pytest.mark.xfail(strict=True, reason="sglang-scaled-mm-bias-rounding: no upstream report found; vLLM's copy adds "
                                       "the bias before the rounding")
def test_bias_is_added_before_the_output_rounding():
    fp8_kernel = _sglang_gemm_module()
    a = torch.zeros(16, 16)
    a[0, 0] = 1.0
    b = torch.zeros(16, 16)  # [K, N]
    b[0, 0] = 1.0
    scale_a = torch.ones(16, 1)
    scale_b = torch.full((16, 1), 1 + 2.0**-11)  # acc * scale: 1 + 2**-11, a tie in fp16 (rounds to 1)
    bias = torch.full((16,), 2.0**-12, dtype=torch.float16)
    y = fp8_kernel.triton_scaled_mm(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), scale_a, scale_b,
                                    torch.float16, bias=bias)
    exact = 1 + 2.0**-11 + 2.0**-12  # 1.000732..., nearest fp16: 1 + 2**-10
    once = torch.tensor(exact, dtype=torch.float64).to(torch.float16)
    assert y[0, 0].item() == once.item(), f"got {y[0, 0].item()!r}, correctly rounded {once.item()!r}"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
