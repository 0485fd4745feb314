"""jax 0.10 MXFP8 quantizer (``jax.nn.scaled_dot_general``'s ``quantize`` with the "mxfp8" config) on
XLA:CPU: an all-zero 32-element block gets E8M0 code 0, whose stand-in value 2**-127 is a subnormal
that XLA:CPU flushes to zero, so the block's codes are 0 / 0 = NaN (bf16 and fp32 input; fp16 input
uses a 2**-15 stand-in, which survives). Standalone
reproduction, no fp8ref; fails today (strict xfail). ``python tests/findings/test_jax_mxfp8.py``.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402


@pytest.mark.xfail(strict=True, reason="jax-mxfp8-zero-block-nan: no upstream report found")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # fp16: its 2**-15 stand-in survives
def test_all_zero_block_quantizes_to_zero_codes(dtype):
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64)), dtype=dtype)
    x = x.at[1, :32].set(0)  # one all-zero MX block
    q, scales = quantize(x, jax.nn.get_scaled_dot_general_config("mxfp8"))
    codes = np.asarray(q.astype(jnp.float32))
    assert not np.isnan(codes).any(), f"E8M0 scales {np.asarray(scales.view(jnp.uint8)).tolist()}: " \
                                      f"{int(np.isnan(codes).sum())} NaN codes"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
