"""A test-harness patch of Triton's CPU interpreter: correctly rounding float downcasts, bf16
arithmetic and int1 comparisons, applied only while fp8ref certifies a third-party Triton kernel.

Why. Triton 3.9's interpreter (``TRITON_INTERPRET=1``, the only way to run Triton on a CPU) gets
these things wrong that a GPU gets right (``fp8ref/conformance/known_failures.py``):

* ``interpreter._convert_float`` rounds fp32 -> fp8 with ties *away from zero* and, when rounding
  carries out of the mantissa, ORs the carry into the exponent field instead of adding it
  (124, 125 and 127.9 all become 64); 2.4-6 % of codes are wrong (triton#8322; open fixes
  triton PR#9808 for the ties, PR#11897 for the carry);
* fp32 -> bf16 (``.to(tl.bfloat16)``, a bf16 store) truncates instead of rounding to nearest even;
* bf16 values are held as uint16 and ``+ - * /`` on two bf16 tensors operate on the bit patterns
  (``c = acc.to(bf16); c += bias`` returns ~1e38);
* fp8 -> wider upcasts decode NaN and Inf codes as finite numbers (0x7F E4M3FN -> 480);
* bf16 -> fp32 of a subnormal is renormalized for an exponent range fp32 does not have: every bf16
  subnormal widens wrongly (2**-127 -> 0);
* a comparison's result is labelled with its operands' dtype (int32) instead of int1; splatted to
  a block (a scalar condition such as ``row < M`` combined with a block mask) it becomes an int32
  array, which ``tl.load`` and ``tl.store`` reject ("mask has unsupported dtype").

A kernel certified under the unpatched interpreter would be blamed for Triton's bugs. Inside
``correct_downcasts()``:

* fp32/fp16/bf16 -> fp8 (e4m3fn, e5m2, e4m3fnuz, e5m2fnuz) with the default rounding (RTNE) is
  ml_dtypes' round-to-nearest-even after a clamp to the format's finite range, i.e. the
  ``cvt.rn.satfinite`` conversion Triton emits on NVIDIA GPUs; NaN stays NaN;
* fp32/fp64 -> bf16 is round-to-nearest-even (IEEE overflow to +-Inf);
* fp8 -> fp16/bf16/fp32 (what ``tl.dot`` on FP8 operands does first) keeps NaN and Inf codes
  (the interpreter turns E4M3FN's NaN 0x7F into 480, E5M2's Inf into 65536, E4M3FNUZ's NaN 0x80
  into -0, so a NaN code vanishes inside a GEMM);
* bf16 -> fp32 is exact (the bf16 bits become the fp32's high half), subnormals included;
* a binary op on bf16 operands is computed on their fp32 values and rounded to nearest even once,
  which is the correctly rounded bf16 result (fp32 holds more than 2 * 8 + 2 bits, so the double
  rounding is innocuous) -- what ``add.rn.bf16`` and friends return on a GPU;
* a comparison is an int1 tensor, as the compiler types it.

Anything else (fp16 -> fp32 upcasts, round-toward-zero requests, fp8e4b15) goes to Triton's own code. The
patch is undone on exit and is not thread-safe (the interpreter is single-threaded anyway).
``tests/test_peers_triton_interpreter.py`` runs the same checks with and without the patch: the
unpatched runs are strict xfails, so the patch is removed when Triton is fixed.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

__all__ = ["correct_downcasts", "patch_active"]

_LOCK = threading.RLock()
_DEPTH = 0


def _targets():
    import ml_dtypes
    import triton.language as tl

    fp8 = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2,
           tl.float8e4b8: ml_dtypes.float8_e4m3fnuz, tl.float8e5b16: ml_dtypes.float8_e5m2fnuz}
    return tl, fp8


def _as_float32(data: np.ndarray, dtype, tl) -> np.ndarray | None:
    """The values of an interpreter tensor as float32 (exact), or None for dtypes not handled."""
    if dtype == tl.float32:
        return np.asarray(data, dtype=np.float32)
    if dtype == tl.float16:
        return np.asarray(data, dtype=np.float16).astype(np.float32)
    if dtype == tl.float64:
        return None
    if dtype == tl.bfloat16:
        return (np.asarray(data).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return None


def _bf16_bits(v: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(v, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _make_convert(original):
    import ml_dtypes

    tl, fp8 = _targets()
    from triton._C.libtriton import ir as _ir

    rtne = (None, _ir.ROUNDING_MODE.RTNE)

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:  # exact: bf16 is fp32's high half
            return (np.asarray(input).astype(np.uint32) << np.uint32(16)).reshape(np.shape(input))
        if input_dtype in fp8 and output_dtype.primitive_bitwidth > 8:  # upcast: exact, NaN/Inf kept
            vals = np.asarray(input).astype(np.uint8).view(fp8[input_dtype]).astype(np.float32)
            out = {tl.float16: lambda v: v.astype(np.float16).view(np.uint16),
                   tl.bfloat16: lambda v: v.astype(ml_dtypes.bfloat16).view(np.uint16),
                   tl.float32: lambda v: v.view(np.uint32),
                   tl.float64: lambda v: v.astype(np.float64).view(np.uint64)}.get(output_dtype)
            if out is not None:
                return out(vals).reshape(np.shape(input))
        if rounding_mode in rtne and input_dtype.primitive_bitwidth > output_dtype.primitive_bitwidth:
            if output_dtype in fp8:
                vals = (np.asarray(input, dtype=np.float64) if input_dtype == tl.float64
                        else _as_float32(input, input_dtype, tl))
                if vals is not None:
                    mdt = fp8[output_dtype]
                    fmax = float(ml_dtypes.finfo(mdt).max)
                    clamped = np.where(np.isnan(vals), vals, np.clip(vals, -fmax, fmax))
                    return clamped.astype(mdt).view(np.uint8).reshape(np.shape(input))
            elif output_dtype == tl.bfloat16 and input_dtype in (tl.float32, tl.float64):
                vals = np.asarray(input, dtype=np.float64 if input_dtype == tl.float64 else np.float32)
                return vals.astype(ml_dtypes.bfloat16).view(np.uint16).reshape(np.shape(input))
        return original(input, input_dtype, output_dtype, rounding_mode)

    return convert


def _make_binary_op(original):
    tl, _ = _targets()
    from triton.runtime.interpreter import TensorHandle

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar == tl.bfloat16 and rhs.dtype.scalar == tl.bfloat16:
            a, b = _as_float32(lhs.data, tl.bfloat16, tl), _as_float32(rhs.data, tl.bfloat16, tl)
            out = op(a, b)
            if out.dtype == np.float32:
                return TensorHandle(_bf16_bits(out), tl.bfloat16)
            return TensorHandle(out, lhs.dtype.scalar) if out.dtype != np.bool_ else TensorHandle(out, tl.int1)
        out = original(self, lhs, rhs, op)
        if out.data.dtype == np.bool_ and out.dtype != tl.int1:  # a comparison of non-bool operands
            return TensorHandle(out.data, tl.int1)
        return out

    return binary_op


def patch_active() -> bool:
    """Whether ``correct_downcasts`` is in effect."""
    return _DEPTH > 0


@contextlib.contextmanager
def correct_downcasts():
    """Run Triton's interpreter with correctly rounding downcasts and bf16 arithmetic (see the
    module docstring); a no-op when triton is not importable. Re-entrant.

    Examples
    --------
    >>> import os; os.environ.setdefault("TRITON_INTERPRET", "1")
    '1'
    >>> from fp8ref.peers.triton_interpreter import correct_downcasts, patch_active
    >>> with correct_downcasts():
    ...     patch_active()
    True
    """
    global _DEPTH
    try:
        from triton.runtime import interpreter
    except Exception:
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            saved = (interpreter._convert_float, interpreter.InterpreterBuilder.binary_op)
            interpreter._convert_float = _make_convert(saved[0])
            interpreter.InterpreterBuilder.binary_op = _make_binary_op(saved[1])
            correct_downcasts._saved = saved
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                interpreter._convert_float, interpreter.InterpreterBuilder.binary_op = correct_downcasts._saved
