"""LMDeploy 0.18.0 ``blocked_gemm_fp8`` (``lmdeploy/pytorch/kernels/cuda/blocked_gemm_fp8.py``, the
Triton GEMM of ``TritonLinearBlockedF8Impl``, what a blocked-FP8 linear runs on a GPU without
DeepGEMM or Hopper Gluon) keeps its fp32 accumulator in units of the current K tile's scale product
``s_k = a_s[k] * b_s[k]``: it starts from ``1 / s_0`` and multiplies by ``s_(k-1) / s_k`` per tile.
A zero weight-block scale, or a product ``a_s * b_s`` at most 2**-128 (its reciprocal overflows
fp32), makes ``inf``, then ``0 * inf`` or ``inf * 0``: NaN outputs where the product is finite.
Standalone reproduction, no fp8ref; runs the kernel in Triton's CPU interpreter with fp32 output and
exactly representable values (small integer codes, power-of-two scales), so the expected output is
exact. The kernel's scalar ``k_start < K`` load masks need one fix of Triton 3.9's interpreter (a
comparison is labelled int32, not int1: ``tests/findings/test_triton_interpreter.py``), applied
here around the call. Fails today (strict xfail on the assertion).
``python tests/findings/test_lmdeploy_blocked_gemm.py`` runs it and exits 1.
"""

import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytest.importorskip("lmdeploy")


def _kernels():
    # The CPU harness's answers to the module's device queries: the quantizer's grid is sized from
    # CUDA device properties (unused by the GEMM), TMA needs a Hopper GPU (False: the non-TMA kernel,
    # which pre-Hopper GPUs run; same arithmetic), and the autotuner cannot time configurations in the
    # interpreter (equal times: the first configuration runs).
    from lmdeploy.pytorch.kernels.cuda import blocked_gemm_fp8 as mod
    from lmdeploy.pytorch.kernels.cuda import utils

    utils.supports_tma = lambda device=None: False
    mod._gemm_fp8_kernel.__dict__["do_bench"] = lambda kernel_call, quantiles: [1.0, 1.0, 1.0]
    return mod


@contextlib.contextmanager
def _comparisons_typed_int1():
    """The interpreter labels a comparison of int32 values int32 (the compiler: int1), so a scalar
    condition splatted into a load mask is an int32 array that ``tl.load`` rejects; label it int1."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.binary_op

    def binary_op(self, lhs, rhs, op):
        out = original(self, lhs, rhs, op)
        if out.data.dtype == np.bool_ and out.dtype != tl.int1:
            return interpreter.TensorHandle(out.data, tl.int1)
        return out

    interpreter.InterpreterBuilder.binary_op = binary_op
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.binary_op = original


def _gemm(a_codes, a_scale, w_codes, w_scale):
    """What TritonLinearBlockedF8Impl._gemm passes: the [N, K] weight and its scales transposed."""
    mod = _kernels()
    with _comparisons_typed_int1():
        return mod.blocked_gemm_fp8(a_codes.to(torch.float8_e4m3fn), a_scale, w_codes.to(torch.float8_e4m3fn).t(),
                                    w_scale.t(), out_dtype=torch.float32)


def _exact(a_codes, a_scale, w_codes, w_scale):
    a = a_codes.double() * a_scale.double().repeat_interleave(128, 1)
    w = w_codes.double() * w_scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return a @ w.t()


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="lmdeploy-blocked-gemm-scale-reciprocal: no upstream report found")
def test_small_scale_product_gives_its_finite_output():
    # M = 1, N = 128, K = 256 (two K tiles); a_s * b_s = 2**-129: the output, 256 * 2**-129 = 2**-121,
    # is a normal fp32 number
    a, w = torch.ones(1, 256), torch.ones(128, 256)
    sa, sw = torch.full((1, 2), 2.0**-64), torch.full((1, 2), 2.0**-65)
    got, want = _gemm(a, sa, w, sw), _exact(a, sa, w, sw).float()
    assert torch.equal(got, want), f"got {got[0, :3].tolist()}, exact {want[0, :3].tolist()}"


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="lmdeploy-blocked-gemm-scale-reciprocal: no upstream report found")
def test_zero_weight_block_scale_contributes_zero():
    # a 256 x 256 weight of ones whose block (0, 1) is all zero with scale 0 (what a quantizer without
    # an amax floor writes for an all-zero block): outputs 128 (first 128 columns) and 256
    a, w = torch.ones(1, 256), torch.ones(256, 256)
    w[:128, 128:] = 0
    sa, sw = torch.ones(1, 2), torch.ones(2, 2)
    sw[0, 1] = 0.0
    got, want = _gemm(a, sa, w, sw), _exact(a, sa, w, sw).float()
    bad = int((got != want).sum())
    assert not bad, f"{bad} of {got.numel()} outputs differ, e.g. {got[0, :2].tolist()} (exact {want[0, :2].tolist()})"


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
