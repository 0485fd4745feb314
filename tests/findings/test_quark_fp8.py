"""AMD Quark 0.13 FP8 real quantization (``quark.torch.kernel.ScaledRealQuantizeFunction``, the
``real_quantize_fp8_*`` functions of ``hw_emulation_interface.py``): ``x / scale`` is computed in x's
dtype (two roundings for bf16/fp16 input), and per channel the fp32 scale is first cast to x's
dtype, so an fp16 model's small channel scales flush to zero (NaN and saturated codes).
Standalone reproduction, no fp8ref; fails today (strict xfail).
``python tests/findings/test_quark_fp8.py`` runs it and exits 1.
"""

import pytest
import torch

pytest.importorskip("quark.torch.kernel")
from quark.torch.kernel import ScaledRealQuantizeFunction  # noqa: E402


def _quantize(x, scale, qscheme, axis=None):
    return ScaledRealQuantizeFunction.apply("fp8_e4m3", x, scale, None, axis, None, -448.0, 448.0, None, qscheme)


@pytest.mark.xfail(strict=True, reason="quark-fp8-low-precision-division: no upstream report found")
def test_bf16_input_is_rounded_once():
    x = torch.tensor([[1.921875]], dtype=torch.bfloat16)
    scale = torch.tensor(0.0228271484375, dtype=torch.float32)  # the fp32 scale an observer stores
    q = _quantize(x, scale, "per_tensor")
    # x / s = 84.1925...; the nearest E4M3 value is 88. In bf16 the quotient is 84.0, an exact tie
    # between 80 and 88, which rounds to even: 80.
    once = (x.float() / scale).to(torch.float8_e4m3fn)
    assert q.float().item() == once.float().item() == 88.0, f"got code {q.float().item()}"


@pytest.mark.xfail(strict=True, reason="quark-fp8-channel-scale-in-input-dtype: no upstream report found")
def test_fp16_small_channel_scale_keeps_its_codes():
    x = torch.tensor([[2.0**-20, 0.0, -(2.0**-21)]], dtype=torch.float16)  # one small output channel
    scale = torch.tensor([2.0**-26], dtype=torch.float32)  # a normal fp32 scale, below fp16's range
    q = _quantize(x, scale, "per_channel", axis=0)
    # x / s is exact: 64, 0, -32. The scale cast to fp16 is 0: x / 0 gives Inf (clamped to 448) and NaN.
    assert q.float().tolist() == [[64.0, 0.0, -32.0]], f"got codes {q.float().tolist()}"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
