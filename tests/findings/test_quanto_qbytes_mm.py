"""optimum-quanto 0.2.7 ``qbytes_mm`` on the CPU, as its W8A8 ``QBytesTensor`` matmul calls it
(``tensor/weights/qbytes.py``: ``qbytes_mm(input._data, other._data, input._scale * other._scale)``):
the two scales are multiplied in their own dtype (bf16 for a bf16 model), then the weight codes are
scaled in bf16 before the matmul (``library/qbytes_mm.py``). A scale product below bf16's smallest
subnormal (2**-133) is 0, so every output is 0 where the exact result is a normal bf16 number.
Found by the conformance sweep's tiny-scale GEMM items (scales 2**-70 each; the row read *certified*
before them). Standalone reproduction, no fp8ref; fails today (strict xfail).
``python tests/findings/test_quanto_qbytes_mm.py``.
"""

import pytest
import torch

pytest.importorskip("optimum.quanto")
import optimum.quanto  # noqa: E402,F401 -- registers torch.ops.quanto


@pytest.mark.xfail(strict=True, reason="quanto-qbytes-mm-scale-product-underflow: no upstream report found")
def test_tiny_scales_keep_a_normal_result():
    a = torch.full((1, 40), 448.0).to(torch.float8_e4m3fn)  # activation codes, one scale per tensor
    w = torch.full((2, 40), 448.0).to(torch.float8_e4m3fn)  # weight codes, one scale per output channel
    sa = torch.tensor([[2.0 ** -70]], dtype=torch.bfloat16)
    sw = torch.full((2, 1), 2.0 ** -70, dtype=torch.bfloat16)
    got = torch.ops.quanto.qbytes_mm(a, w, sa * sw)  # what QBytesTensor's matmul passes
    # exact: 40 * 448 * 448 * 2**-140 = 8028160 * 2**-140 ~ 5.8e-36, a normal bf16 value
    want = torch.tensor(40 * 448.0 * 448.0, dtype=torch.float64) * 2.0 ** -140
    assert float(want) > torch.finfo(torch.bfloat16).tiny
    assert bool((got != 0).all()), \
        f"qbytes_mm gave {got.tolist()} for {float(want):.4g} (scale product {(sa * sw).flatten().tolist()})"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
