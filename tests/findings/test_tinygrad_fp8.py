"""tinygrad 0.14 lowers ``x / y`` to ``x * reciprocal(y)``: for a subnormal divisor the reciprocal
overflows to Inf, so ``0 / s`` is NaN and a finite ``x / s`` is Inf, which tinygrad's cast to E4M3
turns into NaN (it saturates finite values only). An FP8 quantizer written with tinygrad's division
gives NaN codes for every block whose scale is subnormal (a quantizer that keeps subnormal scales,
with no amax floor). Runs on tinygrad's PYTHON device (its CPU device needs
clang). Standalone reproduction, no fp8ref; fails today (strict xfail).
``python tests/findings/test_tinygrad_fp8.py`` runs it and exits 1.
"""

import os

import pytest

os.environ.setdefault("DEV", "PYTHON")
pytest.importorskip("tinygrad")
import numpy as np  # noqa: E402
from tinygrad import Tensor, dtypes  # noqa: E402


@pytest.mark.xfail(strict=True, reason="tinygrad-division-subnormal-divisor: no upstream report found")
def test_division_by_a_subnormal_scale():
    s = np.float32(2.0**-140) / np.float32(448)  # the scale of a block with amax 2**-140: subnormal
    x = np.array([0.0, 2.0**-140], dtype=np.float32)
    q = (Tensor(x) / Tensor(np.full(2, s, np.float32))).cast(dtypes.fp8e4m3).cast(dtypes.float32).numpy()
    once = (x / s).astype(np.float32)  # 0 and 448 (x / s is exact here up to one rounding)
    assert np.array_equal(q, np.clip(once, -448, 448)), f"got {q.tolist()}, x / s is {once.tolist()}"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
