"""optimum-quanto 0.2.7 ``qfloat8`` weights (``absmax_scale`` + ``quantize_symmetric``, what
``quantize_weight`` runs): standalone reproductions, no fp8ref; fail today (strict xfail).
``python tests/findings/test_quanto_qfloat8.py`` runs them and exits 1.
"""

import pytest
import torch

pytest.importorskip("optimum.quanto")
from optimum.quanto import qfloat8  # noqa: E402
from optimum.quanto.calibrate import absmax_scale  # noqa: E402


def _quantize(w):
    scale = absmax_scale(w, qfloat8, axis=0)
    return torch.ops.quanto.quantize_symmetric(w, dtype=qfloat8.dtype, axis=0, scale=scale), scale


@pytest.mark.xfail(strict=True, reason="quanto-zero-row-nan: no upstream report found")
def test_all_zero_output_channel_quantizes_to_zero_codes():
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    w[3] = 0  # a pruned output channel
    q, scale = _quantize(w)
    assert not torch.isnan(q.float()).any(), f"scale {scale[3].item()}: {int(torch.isnan(q.float()).sum())} NaN codes"


@pytest.mark.xfail(strict=True, reason="quanto-bf16-double-rounding: no upstream report found")
def test_bf16_weights_are_rounded_once():
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale = _quantize(w)
    once = (w.float() / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    wrong = (q.view(torch.uint8) != once.view(torch.uint8)).float().mean().item()
    assert wrong == 0, f"{wrong:.2%} of codes differ from one rounding of w / scale (rounded to bf16 first)"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
