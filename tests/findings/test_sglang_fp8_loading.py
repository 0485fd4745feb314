"""SGLang 0.5.23 FP8 weight loading (``sglang/srt/layers/quantization/utils.py``). Standalone
reproduction, no fp8ref; fails today (strict xfail). ``python tests/findings/test_sglang_fp8_loading.py``
runs it and exits 1.

``requantize_with_max_scale`` (``Fp8LinearMethod.process_weights_after_loading`` for every per-tensor
FP8 checkpoint where CUTLASS is not used: fused QKV / gate-up layers requantize every partition to
the largest partition scale) dequantizes each partition with ``per_tensor_dequantize``:
``tensor.to(torch.float16) * inv_scale`` -- a 0-dim fp32 scale keeps the fp16 dtype, so the
dequantized weight is rounded to fp16 before it is requantized: a third rounding, off by more than
one requantization where the weight is below fp16's normal range (|w| < 6.1e-5) and infinite above
65504. vLLM's copy has the same code (docs/findings.md, finding 39).

The module is loaded from its file: importing the ``sglang.srt.layers.quantization`` package pulls
in every quantization method and, through them, vision-model configs (torchvision).
"""

import importlib.util
import os

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang (docs/certified.md, 'Installing the peers')", allow_module_level=True)
import sglang  # noqa: E402
import torch  # noqa: E402


def _utils():
    path = os.path.join(os.path.dirname(sglang.__file__), "srt", "layers", "quantization", "utils.py")
    spec = importlib.util.spec_from_file_location("sglang_quantization_utils", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.xfail(strict=True, reason="sglang-requantize-fp16-dequantize: no upstream report found")
def test_requantize_dequantizes_without_an_fp16_rounding():
    code = torch.tensor([[0.015625]]).to(torch.float8_e4m3fn)  # an E4M3 subnormal code
    scale = torch.tensor(7.915496826171875e-05)  # a per-tensor checkpoint scale (fp32)
    dq = _utils().per_tensor_dequantize(code, scale)
    exact = 0.015625 * 7.915496826171875e-05
    assert dq.dtype != torch.float16 and float(dq[0, 0]) == exact, (
        f"dequantized {float(dq[0, 0])!r} ({dq.dtype}); the product is {exact!r}")


@pytest.mark.xfail(strict=True, reason="sglang-requantize-fp16-dequantize: no upstream report found")
def test_requantize_dequantize_does_not_overflow():
    code = torch.tensor([[448.0]]).to(torch.float8_e4m3fn)
    dq = _utils().per_tensor_dequantize(code, torch.tensor(256.0))  # a weight of 114688: finite in bf16 and fp32
    assert bool(torch.isfinite(dq).all()), f"dequantized {float(dq[0, 0])}"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "--runxfail"]) != 0)
