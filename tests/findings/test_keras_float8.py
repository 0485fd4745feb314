"""keras 3.15.1 float8 (``Dense.quantize("float8")``, ``keras.quantizers``) on the torch backend:
four deviations of the layer's fake quantization, each through keras's own public functions.
Standalone reproduction, no fp8ref; each fails today (strict xfail).
``python tests/findings/test_keras_float8.py`` runs them and exits 1.
"""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # keras picks its backend when first imported
keras = pytest.importorskip("keras")
import torch  # noqa: E402
from keras import quantizers  # noqa: E402

if keras.config.backend() != "torch":
    pytest.skip(f"keras runs on {keras.config.backend()}; these reproductions use the torch backend",
                allow_module_level=True)

E4M3_MAX = 448.0
_NO_REPORT = "no upstream report found"


def _scale(amax: float) -> float:
    """keras' delayed scale after a step on a tensor with this amax (scale 1 before, margin 0)."""
    one = torch.ones((), dtype=torch.float32)
    return float(quantizers.compute_float8_scale(torch.tensor(amax, dtype=torch.float32), one,
                                                 torch.tensor(E4M3_MAX, dtype=torch.float32)))


def _qdq(x: torch.Tensor, scale: float, compute_dtype: str) -> torch.Tensor:
    s = torch.tensor(scale, dtype=torch.float32)
    return quantizers.quantize_and_dequantize(x, s, "float8_e4m3fn", compute_dtype).float()


@pytest.mark.xfail(strict=True, reason=f"keras-float8-tiny-amax-zero-scale-bf16, -fp32: {_NO_REPORT}")
def test_tiny_tensor_gets_a_nonzero_scale():
    # amax = 1e-36 is a normal fp32 value, but 448 / amax overflows to Inf and 1 / Inf = 0
    scale = _scale(1e-36)
    x = torch.tensor([[1e-36, 0.0, -5e-37]], dtype=torch.float32)
    y = _qdq(x, scale, "float32")
    # with scale 0: x / 0 = +-Inf clips to +-448 and dequantizes to 0; 0 / 0 is NaN
    assert scale > 0 and bool(torch.isfinite(y).all()), f"scale {scale!r}; quantize_and_dequantize gave {y.tolist()}"


_JAX_SCALE = """
import jax.numpy as jnp
from keras import quantizers
print(float(quantizers.compute_float8_scale(jnp.float32(4e-36), jnp.float32(1.0), jnp.float32(448.0))))
"""


@pytest.mark.xfail(strict=True, reason=f"keras-float8-tiny-amax-zero-scale-jax-bf16, -fp32: {_NO_REPORT}")
def test_tiny_tensor_gets_a_nonzero_scale_on_jax():
    pytest.importorskip("jax")
    # keras picks one backend per process: the jax backend in a fresh one. amax = 4e-36 is above
    # 448 / FLT_MAX, so 448 / amax is finite, but 1 / (448 / amax) = 8.9e-39 is subnormal and XLA:CPU
    # flushes it to 0 (the torch backend keeps it): the jax layer loses tensors up to amax 448 * 2**-126.
    env = dict(os.environ, KERAS_BACKEND="jax")
    out = subprocess.run([sys.executable, "-c", _JAX_SCALE], capture_output=True, text=True, env=env, check=True)
    scale = float(out.stdout.split()[-1])
    assert scale > 0, f"scale {scale!r} for amax 4e-36 on the jax backend"


_JAX_FP16_QDQ = """
import jax.numpy as jnp
from keras import quantizers
x = jnp.asarray([0.006103515625, -0.003509521484375, -0.0050048828125], jnp.float16)  # amax 0.0061
scale = quantizers.compute_float8_scale(jnp.float32(0.006103515625), jnp.float32(1.0), jnp.float32(448.0))
top = float(jnp.float16(448.0) * scale.astype(jnp.float16))  # the largest code's dequantized value
print(top, *(float(v) for v in quantizers.quantize_and_dequantize(x, scale, "float8_e4m3fn", "float16")))
"""


@pytest.mark.xfail(strict=True, reason=f"keras-float8-jax-fp16-reciprocal-overflow: {_NO_REPORT}")
def test_jax_fp16_small_tensor_keeps_its_values():
    pytest.importorskip("jax")
    # scale = 0.0061 / 448 = 1.37e-5 (fp16 holds it, subnormal); x / scale is at most 448. XLA:CPU
    # evaluates the fp16 division by a 0-d scale as x * (1 / scale) with the reciprocal in fp16, where
    # 1 / 1.37e-5 = 72,990 overflows to Inf: every value clips to +-448 and dequantizes to +-0.0061.
    env = dict(os.environ, KERAS_BACKEND="jax")
    out = subprocess.run([sys.executable, "-c", _JAX_FP16_QDQ], capture_output=True, text=True, env=env, check=True)
    top, *got = (float(v) for v in out.stdout.split()[-4:])
    # x / scale = 446, -256, -365.7: only the first element rounds to the largest code
    assert [abs(g) == top for g in got] == [True, False, False], f"got {got} (largest code: +-{top})"


@pytest.mark.xfail(strict=True, reason=f"keras-float8-fp16-scale-underflow: {_NO_REPORT}")
def test_fp16_small_tensor_keeps_its_values():
    x = torch.tensor([[2.0**-22, 0.0, -(2.0**-23)]], dtype=torch.float16)  # small fp16 activations
    scale = _scale(2.0**-22)  # 2**-22 / 448 in fp32: fine
    y = _qdq(x, scale, "float16")
    # quantize_and_dequantize casts the scale to the compute dtype, where 2**-22 / 448 (< 2**-25) is 0
    assert y.tolist() == x.float().tolist(), f"scale {scale:g}: got {y.tolist()} for {x.float().tolist()}"


@pytest.mark.xfail(strict=True, reason=f"keras-float8-fp32-bias-bf16: {_NO_REPORT}")
def test_fp32_layer_adds_its_bias_unrounded():
    layer = keras.layers.Dense(1, dtype="float32")
    layer.build((None, 4))
    bias = 1.0 + 2.0**-10  # an fp32 value that bf16 (8 significant bits) cannot hold
    layer.bias.assign(torch.tensor([bias]))
    layer.quantize("float8")
    y = float(layer(torch.zeros(1, 4), training=False)[0, 0])
    # the kernel is irrelevant (x = 0): y is the bias; _float8_call rounds an fp32 bias to bf16 first
    assert y == bias, f"got {y!r}, bias {bias!r}"


@pytest.mark.xfail(strict=True, reason=f"keras-float8-double-rounding-bf16, -fp16: {_NO_REPORT}")
def test_bf16_input_is_rounded_once():
    s = 0.0228271484375  # a bf16 value (187 * 2**-13)
    x = torch.tensor([[1.921875]], dtype=torch.bfloat16)
    y = _qdq(x, s, "bfloat16")
    # x / s = 84.19...; the nearest E4M3 value is 88. In bf16 the quotient is 84.0, an exact tie between
    # 80 and 88, which rounds to even: 80.
    once = (torch.tensor(1.921875) / torch.tensor(s)).to(torch.float8_e4m3fn).float()
    assert float(once) == 88.0 and float(y[0, 0]) == float((once * s).to(torch.bfloat16)), (
        f"got {float(y[0, 0]) / s:g} * s, one rounding gives {float(once):g} * s")


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
