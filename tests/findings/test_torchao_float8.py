"""torchao 0.18 float8 quantizer (``_choose_scale_float8`` + ``_quantize_affine_float8``, what
``Float8Tensor.from_hp`` / ``Float8DynamicActivationFloat8WeightConfig`` run): standalone
reproductions, no fp8ref. Each test states the correct behaviour and fails today (strict xfail, so
an upstream fix fails the suite and the entry gets removed); ``python tests/findings/<this file>``
runs them as plain tests and exits 1.

docs/findings.md explains each and why it matters for a served model.
"""

import pytest
import torch

qp = pytest.importorskip("torchao.quantization.quant_primitives")


@pytest.mark.xfail(strict=True, reason="torchao-zero-block-nan: pytorch/ao#4713 (fix PRs #4714, #4762 open)")
def test_all_zero_row_quantizes_to_zero_codes():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x[1] = 0  # e.g. a padding token's activations
    scale = qp._choose_scale_float8(x, [1, 64], torch.float8_e4m3fn)
    q = qp._quantize_affine_float8(x, scale, torch.float8_e4m3fn)
    n_nan = int(torch.isnan(q.float()).sum())
    assert not n_nan, f"scale of the zero row {scale[1].item()}: {n_nan} NaN codes"


@pytest.mark.xfail(strict=True, reason="torchao-row-k1-crash: no upstream report found")
def test_per_row_scaling_of_a_single_column():
    x = torch.randn(3, 1)  # K = 1: block_size [1, 1]
    scale = qp._choose_scale_float8(x, [1, 1], torch.float8_e4m3fn)  # RuntimeError: shape '[3, 1]' is invalid
    assert scale.shape == (3, 1)


@pytest.mark.xfail(strict=True, reason="torchao-e8m0-nearest: no upstream report found (see ml_dtypes#298)")
def test_e8m0_scale_never_clips_the_block_maximum():
    # amax / 448 = 1.4 rounds to the *nearest* power of two, 1, so 627.2 / 1 is clamped to 448
    x = torch.tensor([[627.2, 1.0]])
    scale = qp._choose_scale_float8(x, [1, 2], torch.float8_e4m3fn, scale_dtype=torch.float8_e8m0fnu)
    q = qp._quantize_affine_float8(x, scale, torch.float8_e4m3fn)
    err = abs(q[0, 0].float().item() * scale.item() - 627.2) / 627.2
    assert err <= 2**-4, f"scale {scale.item()}: the block maximum comes back {err:.0%} too small"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
