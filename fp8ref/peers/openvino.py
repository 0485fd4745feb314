"""OpenVINO (CPU plugin): FP8 as an ONNX model reaches it, and as an OpenVINO graph states it.

Every model is compiled on ``"CPU"`` with ``INFERENCE_PRECISION_HINT=f32``, pinned: the plugin's
default on a CPU with AVX512-BF16 or AMX is bf16, which rounds the dequantized operands and runs the
MatMul in bf16 (``runtimePrecision`` bf16 in the compiled model); f32 makes the row independent of
the machine. ``INFERENCE_NUM_THREADS=1``: deterministic, and the machine has two cores.

* ``openvino-onnx-qdq``: the ONNX graphs of ``onnxruntime-qdq`` (``fp8ref.peers.onnxruntime``) read
  by OpenVINO's ONNX frontend (``Core.read_model``). The frontend translates ``QuantizeLinear`` to
  FP8 as ``Divide(x, y_scale)`` -> ``FakeConvert(scale=1, destination_type)`` -> ``Convert``
  (``src/frontends/onnx/frontend/src/op/quantize_linear.cpp``; the compiled model shows the three
  ops), and ``DequantizeLinear`` as ``Convert`` -> ``Multiply``. The quantize graph ends at the FP8
  ``QuantizeLinear`` output: the codes are the bytes the plugin wrote (uint8 in numpy).
* ``openvino-convert``: OpenVINO's own opset, as NNCF's FP8 weight compression writes it. Quantize:
  ``Convert(Divide(x, s), f8e4m3 | f8e5m2)``; scaled_mm: the weight an ``f8`` Constant, ``Convert``
  to f32, ``Multiply`` by its per-tensor or per-channel scale (a ``FullyConnected`` node with
  decompression in the compiled model), the activation an ``f8`` input converted and scaled the same
  way, ``MatMul(transpose_b)``, ``Add(bias)``, all f32.

Both quantizers convert f32 -> FP8 in the plugin's ``Convert`` node
(``src/plugins/intel_cpu/src/nodes/common/cpu_convert.cpp``: oneDNN's FP8 emulation where AVX-512 is
available, ``ov::float8_e4m3`` / ``_e5m2`` otherwise), through fp16: a two-step conversion OpenVINO
chose on purpose (openvino PR #28501), where fp8ref's spec rounds once. ``Convert`` does not saturate
(f8e4m3: overflow and Inf are NaN; f8e5m2: Inf). The plugin decomposes ``FakeConvert`` into
``Multiply``, ``Clamp`` (openvino PR #28651; it also turns NaN into -448), the two ``Convert`` and a
``Divide``, and rewrites every ``Divide(x, s)`` as ``x * Power(s, -1)``: the codes are
``fl32(x * fl32(1 / s))``, declared (``multiply_codes``).
Input enters as fp32 (exact for bf16/fp16); GEMM outputs leave as fp32 and are rounded once to the
output dtype by torch (as for ``onnxruntime-qdq``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..registry import Case
from ..spec.formats import E4M3FN, E5M2
from ..spec.quant import Quantized, expand_scale
from ..spec.schemes import Granularity, QuantScheme
from ._base import Peer, spec_or_given_scale
from .onnxruntime import OnnxRuntimeQDQ, gemm_graph, onnx_model, qdq_attrs, quantize_graph, scale_arg

__all__ = ["PEERS", "COMPILE_CONFIG"]

#: Pinned compile properties (see the module docstring).
COMPILE_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1}


@functools.lru_cache(maxsize=1)
def _core():
    import openvino as ov

    return ov.Core()


def _compile(model):
    return _core().compile_model(model, "CPU", COMPILE_CONFIG)


def _from_onnx(graph):
    return _compile(_core().read_model(onnx_model(graph).SerializeToString(), b""))


# The CPU plugin takes no input of unknown rank: the graphs declare their shapes.
@functools.lru_cache(maxsize=64)
def _onnx_quantize(fmt, attrs: tuple, scale_shape: tuple[int, ...], x_shape: tuple[int, int]):
    return _from_onnx(quantize_graph(fmt, attrs, scale_shape, dequantize=False, x_shape=x_shape))


@functools.lru_cache(maxsize=64)
def _onnx_gemm(fa, a_attrs: tuple, a_shape: tuple, fb, b_attrs: tuple, b_shape: tuple, bias: bool,
               mnk: tuple[int, int, int]):
    return _from_onnx(gemm_graph(fa, a_attrs, a_shape, fb, b_attrs, b_shape, bias, mnk))


def _ov_type(fmt):
    import openvino as ov

    return {E4M3FN: ov.Type.f8e4m3, E5M2: ov.Type.f8e5m2}[fmt]


def _codes(out: np.ndarray, scheme: QuantScheme) -> torch.Tensor:
    # the plugin hands FP8 tensors to numpy as their bytes (uint8)
    if out.dtype != np.uint8:
        raise TypeError(f"OpenVINO returned {out.dtype} for an FP8 output, expected its bytes (uint8)")
    return torch.from_numpy(out.copy()).view(scheme.format.torch_dtype)


def _fp8_tensor(q: torch.Tensor):
    """An OpenVINO FP8 tensor holding the bytes of ``q`` (no value changes)."""
    import openvino as ov

    fmt = E4M3FN if q.dtype == torch.float8_e4m3fn else E5M2
    t = ov.Tensor(_ov_type(fmt), ov.Shape(list(q.shape)))
    np.copyto(t.data, q.contiguous().view(torch.uint8).numpy())
    return t


@functools.lru_cache(maxsize=8)
def _convert_quantize(fmt):
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter(ov.PartialShape([-1, -1]), ov.Type.f32, name="x")
    s = ops.parameter(ov.PartialShape([-1, -1]), ov.Type.f32, name="s")
    return _compile(ov.Model([ops.convert(ops.divide(x, s), _ov_type(fmt))], [x, s], "fp8ref_quantize"))


def _multiply_codes(scheme: QuantScheme) -> QuantScheme:
    # the plugin's ConvertDivide pass rewrites Divide(x, s) as Multiply(x, Power(s, -1)): the codes are
    # RNE(fl32(x * fl32(1 / s))), a declared convention (docs/spec.md §3.1, multiply_codes)
    return scheme.with_(multiply_codes=True)


def _schemes(case: Case) -> list[QuantScheme]:
    return [case.recipe.activation] if case.op == "quantize" else [case.recipe.activation, case.recipe.weight]


def _plugin_reason(case: Case, schemes: list[QuantScheme]) -> str | None:
    """What both OpenVINO rows decline: another device, a format OpenVINO has no element type for."""
    if torch.device(case.device).type != "cpu":
        return "the CPU plugin"
    if any(s.format not in (E4M3FN, E5M2) for s in schemes):
        return "OpenVINO's element types are f8e4m3 and f8e5m2 (no E4M3FNUZ)"
    return None


class OpenVinoOnnxQDQ(OnnxRuntimeQDQ):
    name = "openvino-onnx-qdq"
    project = "OpenVINO"
    distribution = "openvino"
    entry = ("Core.read_model(ONNX QuantizeLinear(saturate=1) / DequantizeLinear + MatMul, opset 21), "
             "compile_model('CPU', INFERENCE_PRECISION_HINT=f32)")
    modules = ("openvino", "onnx")
    notes = ("ONNX frontend: QuantizeLinear -> Divide(x, s) f32 (run as x * (1/s)), FakeConvert (saturating; "
             "f32 -> f16 -> f8 in the CPU JIT), Convert; s given (fp8ref's); GEMM: Convert + Multiply fp32 dequantize, "
             "fp32 MatMul, fp32 bias")
    reference = False

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        return _multiply_codes(scheme)

    def supports(self, case: Case) -> str | None:
        schemes = _schemes(case)
        if (why := _plugin_reason(case, schemes)) is not None:
            return why
        if any(s.granularity is Granularity.GROUP and case.K % s.group_size for s in schemes):
            # ONNX allows a shorter last block; the frontend refuses the model (OpConversionFailure)
            return "the ONNX frontend takes block_size only when it divides the axis"
        return super().supports(case)

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        s = spec_or_given_scale(x, scheme, scale, scheme.scale_dtype)
        arg = scale_arg(s, scheme)
        model = _onnx_quantize(scheme.format, tuple(sorted(qdq_attrs(scheme).items())), arg.shape, tuple(x.shape))
        out = model({"x": x.to(torch.float32).numpy(), "s": arg})[0]
        return Quantized(_codes(out, scheme), s, scheme)

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        M, N = a.data.shape[0], b.data.shape[0]
        sa, sb = scale_arg(a.scale, a.scheme), scale_arg(b.scale, b.scheme)
        model = _onnx_gemm(a.scheme.format, tuple(sorted(qdq_attrs(a.scheme).items())), sa.shape,
                           b.scheme.format, tuple(sorted(qdq_attrs(b.scheme).items())), sb.shape, bias is not None,
                           (M, N, a.data.shape[1]))
        feeds = {"a": a.data.to(torch.float32).numpy(), "sa": sa, "b": b.data.to(torch.float32).numpy(), "sb": sb}
        if bias is not None:
            feeds["bias"] = bias.to(torch.float32).numpy()
        out = model(feeds)[0]
        return torch.from_numpy(out.copy()).reshape(M, N).to(out_dtype)


class OpenVinoConvert(Peer):
    name = "openvino-convert"
    project = "OpenVINO"
    distribution = "openvino"
    entry = ("opset13: Convert(Divide(x, s), f8e4m3 | f8e5m2); f8 Constant weight -> Convert -> Multiply(scale) -> "
             "MatMul(transpose_b) + Add, compile_model('CPU', INFERENCE_PRECISION_HINT=f32)")
    modules = ("openvino",)
    notes = ("codes = Convert(x / s) f32 (run as x * (1/s)), s given (fp8ref's); the CPU JIT converts "
             "f32 -> f16 -> f8, no saturation (f8e4m3 overflow -> NaN); GEMM: Convert + Multiply fp32 dequantize "
             "(FullyConnected with decompression), fp32 MatMul, fp32 bias")
    ops = ("quantize", "scaled_mm")
    output_roundings = 1

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        return _multiply_codes(scheme)

    def supports(self, case: Case) -> str | None:
        schemes = _schemes(case)
        if (why := _plugin_reason(case, schemes)) is not None:
            return why
        for s in schemes:
            if s.scale_dtype != torch.float32:
                return "the Divide / Multiply by the scale is f32"
            if case.op == "quantize" and s.qmax != s.format.max and not s.dynamic:
                return "Convert has no clamp to a lower qmax"
            if case.op != "quantize" and s.granularity not in (Granularity.TENSOR, Granularity.ROW):
                return "NNCF's FP8 dequantization scales are per tensor or per channel"
        if case.op == "quantize" and case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"input dtype {case.x_dtype}"
        if case.op != "quantize" and case.out_dtype == torch.float64:
            return "fp32 MatMul: out_dtype float64 would not be rounded once from the exact result"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        rows, cols = x.shape
        s = spec_or_given_scale(x, scheme, scale, torch.float32)
        full = expand_scale(s, scheme, rows, cols).contiguous()  # one scale per element, exact
        out = _convert_quantize(scheme.format)({"x": x.to(torch.float32).numpy(), "s": full.numpy()})[0]
        return Quantized(_codes(out, scheme), s, scheme)

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        import openvino as ov
        import openvino.opset13 as ops

        M, N = a.data.shape[0], b.data.shape[0]
        # the weight is a Constant, as in an NNCF-compressed model: the plugin folds its Convert and
        # Multiply into the FullyConnected node's decompression
        w = ops.multiply(ops.convert(ops.constant(_fp8_tensor(b.data)), ov.Type.f32),
                         ops.constant(b.scale.to(torch.float32).reshape(-1, 1).numpy()))
        x = ops.parameter(ov.PartialShape(list(a.data.shape)), _ov_type(a.scheme.format), name="a")
        sa = ops.parameter(ov.PartialShape([-1, 1]), ov.Type.f32, name="sa")
        y = ops.matmul(ops.multiply(ops.convert(x, ov.Type.f32), sa), w, False, True)
        params = [x, sa]
        if bias is not None:
            bias_in = ops.parameter(ov.PartialShape([N]), ov.Type.f32, name="bias")
            y = ops.add(y, bias_in)
            params.append(bias_in)
        model = _compile(ov.Model([y], params, "fp8ref_scaled_mm"))
        feeds = {"a": _fp8_tensor(a.data), "sa": a.scale.to(torch.float32).reshape(-1, 1).numpy()}
        if bias is not None:
            feeds["bias"] = bias.to(torch.float32).numpy()
        out = model(feeds)[0]
        return torch.from_numpy(out.copy()).reshape(M, N).to(out_dtype)


PEERS = (OpenVinoOnnxQDQ(), OpenVinoConvert())
