"""ONNX Runtime (CPU execution provider): QuantizeLinear / DequantizeLinear on FP8, and
dequantize-then-MatMul (ORT's CPU provider has no FP8 GEMM).

* ``onnxruntime-qdq`` quantize: ``QuantizeLinear(x, y_scale, zero_point, saturate=1)`` (opset 21)
  computes ``saturate(round_to_nearest_even(x / y_scale))`` in fp32 for FLOAT8E4M3FN, FLOAT8E5M2
  and FLOAT8E4M3FNUZ; per tensor, per row (``axis=0``) or 1 x G blocks (``axis=1, block_size=G``).
  ONNX quantization takes its scale: the adapter gives it fp8ref's dynamic scale (what an exported
  dynamic-quantization graph computes with ReduceMax/Div), so what is certified is ORT's division,
  rounding and saturation. ORT's Python API exchanges no FP8 tensors with numpy, so the graph appends an exact
  ``DequantizeLinear(y, 1)`` and the adapter casts those values back to FP8 (every FP8 value is an
  fp32; -0 and NaN survive).
* ``onnxruntime-qdq`` scaled_mm: the codes enter as fp32 values and ``Cast`` to FP8 (exact),
  ``DequantizeLinear`` of both operands (fp32, ``x * scale``: one
  fp32 rounding each), ``MatMul(A, B^T)`` (MLAS fp32 GEMM), ``Add(bias)`` in fp32; the fp32 result
  is rounded once to the output dtype by torch (an ONNX ``Cast`` does the same, but ORT cannot return
  bf16 to numpy).
* ``onnx-reference-qdq``: the same graphs run by onnx's pure-Python ``onnx.reference.ReferenceEvaluator``
  (the executable form of the operator specification, numpy and ml_dtypes underneath) instead of
  ORT: QuantizeLinear is ``x / y_scale`` in fp32, rounded to nearest even by ml_dtypes' cast, with
  saturation; the GEMM is numpy's fp32 ``MatMul``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..registry import Case
from ..spec.formats import E4M3FN, E4M3FNUZ, E5M2
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import Peer, spec_or_given_scale

__all__ = ["PEERS", "qdq_attrs", "scale_arg", "onnx_model", "quantize_graph", "gemm_graph"]

_OPSET = 21


def _onnx_type(fmt):
    from onnx import TensorProto

    return {E4M3FN: TensorProto.FLOAT8E4M3FN, E5M2: TensorProto.FLOAT8E5M2,
            E4M3FNUZ: TensorProto.FLOAT8E4M3FNUZ}[fmt]


def qdq_attrs(scheme: QuantScheme) -> dict:
    """The QuantizeLinear / DequantizeLinear attributes of ``scheme``'s granularity."""
    g = scheme.granularity
    if g is Granularity.TENSOR:
        return {}
    if g is Granularity.ROW:
        return {"axis": 0}
    return {"axis": 1, "block_size": scheme.group_size}


def scale_arg(scale: torch.Tensor, scheme: QuantScheme) -> np.ndarray:
    """``scale`` as the fp32 array the operators take for ``scheme``'s granularity."""
    s = scale.to(torch.float32).numpy()
    if scheme.granularity is Granularity.TENSOR:
        return s.reshape(())
    if scheme.granularity is Granularity.ROW:
        return s.reshape(-1)
    return s


def _zero_point(name: str, fmt, scale_shape: tuple[int, ...]):
    from onnx import helper

    n = int(np.prod(scale_shape)) if scale_shape else 1
    return helper.make_tensor(name, _onnx_type(fmt), list(scale_shape), [0] * n)


def onnx_model(graph):
    """``graph`` as an opset-21 ONNX model (IR version 10)."""
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = 10
    return model


def _session(graph):
    import onnxruntime as ort

    model = onnx_model(graph)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # deterministic, and the machine has two cores
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


class _Reference:
    """onnx's ReferenceEvaluator behind the ``run(None, feeds)`` call an ORT session answers."""

    def __init__(self, model):
        from onnx.reference import ReferenceEvaluator

        self._ev = ReferenceEvaluator(model)

    def run(self, outputs, feeds):
        return self._ev.run(outputs, feeds)


def _reference_session(graph):
    return _Reference(onnx_model(graph))


def quantize_graph(fmt, attrs: tuple, scale_shape: tuple[int, ...], *, dequantize: bool = True,
                   x_shape: tuple[int, int] | None = None):
    """The ONNX graph ``y = QuantizeLinear(x, s, zero_point, saturate=1)`` (inputs ``x``, ``s``
    fp32); ``dequantize``: the output is ``v = DequantizeLinear(y, 1)`` (fp32, exact), else ``y``
    itself (FP8). ``x_shape``: the inputs' shapes are declared (``x_shape`` and ``scale_shape``),
    else left unknown."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None if x_shape is None else list(x_shape))
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, None if x_shape is None else list(scale_shape))
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"], saturate=1, **dict(attrs))]
    init = [_zero_point("zp", fmt, scale_shape)]
    if dequantize:
        nodes.append(helper.make_node("DequantizeLinear", ["y", "one", "zp0"], ["v"]))
        init += [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]), _zero_point("zp0", fmt, ())]
        out = helper.make_tensor_value_info("v", TensorProto.FLOAT, None)
    else:
        out = helper.make_tensor_value_info("y", _onnx_type(fmt), None)
    return helper.make_graph(nodes, "fp8ref_quantize", [x, s], [out], initializer=init)


@functools.lru_cache(maxsize=64)
def _quantize_session(fmt, attrs: tuple, scale_shape: tuple[int, ...], reference: bool = False):
    graph = quantize_graph(fmt, attrs, scale_shape)
    return _reference_session(graph) if reference else _session(graph)


def gemm_graph(fa, a_attrs: tuple, a_shape: tuple, fb, b_attrs: tuple, b_shape: tuple, bias: bool,
               mnk: tuple[int, int, int] | None = None):
    """The ONNX graph ``out = DequantizeLinear(a) @ DequantizeLinear(b)^T (+ bias)``, fp32, with
    the codes entering as fp32 values (inputs ``a``, ``sa``, ``b``, ``sb``, ``bias``); ``mnk``: the
    inputs' shapes are declared (``a_shape`` and ``b_shape`` are the scales'), else left unknown."""
    from onnx import TensorProto, helper

    M, N, K = mnk if mnk is not None else (None, None, None)
    shapes = {"a": [M, K], "sa": list(a_shape), "b": [N, K], "sb": list(b_shape), "bias": [N]}
    if mnk is None:
        shapes = dict.fromkeys(shapes)
    # The codes enter as their fp32 values and are cast to FP8 exactly (ORT's Python API takes no
    # FP8 numpy input): every FP8 value is an fp32, so the Cast rounds nothing.
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in ("a", "sa", "b", "sb")]
    nodes = [helper.make_node("Cast", ["a"], ["a8"], to=_onnx_type(fa)),
             helper.make_node("Cast", ["b"], ["b8"], to=_onnx_type(fb)),
             helper.make_node("DequantizeLinear", ["a8", "sa", "za"], ["A"], **dict(a_attrs)),
             helper.make_node("DequantizeLinear", ["b8", "sb", "zb"], ["B"], **dict(b_attrs)),
             helper.make_node("Transpose", ["B"], ["Bt"], perm=[1, 0]),
             helper.make_node("MatMul", ["A", "Bt"], ["y" if bias else "out"])]
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, shapes["bias"]))
        nodes.append(helper.make_node("Add", ["y", "bias"], ["out"]))
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    return helper.make_graph(nodes, "fp8ref_gemm", inputs, [out],
                             initializer=[_zero_point("za", fa, a_shape), _zero_point("zb", fb, b_shape)])


@functools.lru_cache(maxsize=64)
def _gemm_session(fa, a_attrs: tuple, a_shape: tuple, fb, b_attrs: tuple, b_shape: tuple, bias: bool,
                  reference: bool = False):
    graph = gemm_graph(fa, a_attrs, a_shape, fb, b_attrs, b_shape, bias)
    return _reference_session(graph) if reference else _session(graph)


class OnnxRuntimeQDQ(Peer):
    name = "onnxruntime-qdq"
    project = "ONNX Runtime"
    distribution = "onnxruntime"
    entry = "QuantizeLinear(saturate=1) / DequantizeLinear + MatMul, CPUExecutionProvider, opset 21"
    modules = ("onnxruntime", "onnx")
    notes = "codes = saturate(RNE(x / s)) fp32, s given (fp8ref's); GEMM: fp32 dequantize, fp32 MatMul, fp32 bias"
    ops = ("quantize", "scaled_mm")
    output_roundings = 1
    reference = False  #: run the graphs with onnx's ReferenceEvaluator instead of ORT

    def supports(self, case: Case) -> str | None:
        if torch.device(case.device).type != "cpu":
            return "CPUExecutionProvider only"
        schemes = [case.recipe.activation] if case.op == "quantize" else [case.recipe.activation, case.recipe.weight]
        for s in schemes:
            if s.granularity is Granularity.BLOCK:
                return "ONNX block quantization runs along one axis (1 x G), not R x C blocks"
            if case.op == "quantize" and s.qmax != s.format.max and not s.dynamic:
                return "saturate=1 clamps at the format's max, not a lower qmax"
            if s.granularity is Granularity.GROUP and case.op == "quantize" and s.group_size > case.K:
                return "block_size larger than the axis"
        if case.op != "quantize" and case.out_dtype == torch.float64:
            return "fp32 MatMul: out_dtype float64 would not be rounded once from the exact result"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        s = spec_or_given_scale(x, scheme, scale, scheme.scale_dtype)
        arg = scale_arg(s, scheme)
        sess = _quantize_session(scheme.format, tuple(sorted(qdq_attrs(scheme).items())), arg.shape, self.reference)
        v = sess.run(None, {"x": x.to(torch.float32).numpy(), "s": arg})[0]
        data = torch.from_numpy(v).to(scheme.format.torch_dtype)
        return Quantized(data, s, scheme)

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        M, N = a.data.shape[0], b.data.shape[0]
        sa, sb = scale_arg(a.scale, a.scheme), scale_arg(b.scale, b.scheme)
        sess = _gemm_session(a.scheme.format, tuple(sorted(qdq_attrs(a.scheme).items())), sa.shape,
                             b.scheme.format, tuple(sorted(qdq_attrs(b.scheme).items())), sb.shape, bias is not None,
                             self.reference)
        feeds = {"a": a.data.to(torch.float32).numpy(), "sa": sa, "b": b.data.to(torch.float32).numpy(), "sb": sb}
        if bias is not None:
            feeds["bias"] = bias.to(torch.float32).numpy()
        out = sess.run(None, feeds)[0]
        return torch.from_numpy(out).reshape(M, N).to(out_dtype)


class OnnxReferenceQDQ(OnnxRuntimeQDQ):
    name = "onnx-reference-qdq"
    project = "ONNX (reference implementation)"
    distribution = "onnx"
    entry = "onnx.reference.ReferenceEvaluator: QuantizeLinear(saturate=1) / DequantizeLinear + MatMul, opset 21"
    modules = ("onnx.reference",)
    notes = ("codes = saturate(RNE(x / s)) fp32 (numpy + ml_dtypes), s given (fp8ref's); GEMM: fp32 dequantize, "
             "numpy fp32 MatMul, fp32 bias")
    reference = True


PEERS = (OnnxRuntimeQDQ(), OnnxReferenceQDQ())
