"""NVIDIA Model Optimizer 0.47 FP8 fake quantization on a CPU (``scaled_e4m3`` -> ``_fp8_eager``):
an amax at or below 2**-24 is treated as 1, so a block whose values are all that small quantizes to
zero codes instead of to its own scale. Standalone reproduction, no fp8ref; fails today (strict
xfail). ``python tests/findings/test_modelopt_fp8.py`` runs it and exits 1.
"""

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization.tensor_quant")
from modelopt.torch.quantization.tensor_quant import scaled_e4m3  # noqa: E402


@pytest.mark.xfail(strict=True, reason="modelopt-tiny-amax: no upstream report found")
def test_a_tiny_block_keeps_its_values():
    x = torch.tensor([[3e-8, -1e-8, 2e-8, 0.0]])  # amax 3e-8 <= 2**-24
    amax = x.abs().amax(dim=1, keepdim=True)
    out = scaled_e4m3(x, amax, None, 4, 3)  # quantize-dequantize with the per-row amax
    assert out.abs().max().item() > 0, "every value of the block came back 0 (amax <= 2**-24 is replaced by 1)"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
