"""jax 0.10 on XLA:CPU: the FP8 ``dot_general`` a jax user writes (``dot(a_fp8, b_fp8,
preferred_element_type=float32) * sa * sb + bias``, jit-compiled) flushes a subnormal fp32 result to
zero: XLA:CPU's compiled code runs with flush-to-zero, so codes whose scaled product lies below
2**-126 (about 1.2e-38) come back as 0 (or -0). IEEE arithmetic keeps them (the spec, numpy, torch's
fp32 path). Found by the conformance magnitude sweep (scales 2**-70 on both operands). Standalone
reproduction, no fp8ref; fails today (strict xfail). ``python tests/findings/test_jax_xla_dot.py``.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402


@pytest.mark.xfail(strict=True, reason="jax-xla-dot-ftz: no upstream report found (XLA:CPU flushes subnormals)")
def test_subnormal_scaled_product_is_kept():
    @jax.jit
    def dot(a, b, sa, sb):
        y = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y * sa * sb

    a = jnp.full((1, 4), 1.5, dtype=jnp.float8_e4m3fn)
    b = jnp.full((1, 4), -2.0, dtype=jnp.float8_e4m3fn)
    s = jnp.float32(2.0 ** -70)
    got = float(np.asarray(dot(a, b, s, s))[0, 0])
    # 4 * 1.5 * -2 = -12, times 2**-140: -12 * 2**-140 = -1.5 * 2**-137, a subnormal fp32 (exact)
    want = float(np.float32(-12.0) * np.float32(2.0 ** -70) * np.float32(2.0 ** -70))
    assert want != 0.0  # numpy keeps the subnormal
    assert got == want, f"XLA:CPU returned {got!r} for {want!r} (-12 x 2**-140)"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
