"""Building blocks of the catalogue: the correct fp32 base backend and the pieces mutants change.

``Fp32Base`` is the reference quantizer (static scales included) and an fp32 scaled GEMM: per
K-segment ``codes @ codes^T`` in fp32, scaled by ``sa sb`` in fp32, bias added last. It conforms
to the ``fp32`` declaration; every mutant and variant changes one thing.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from fp8ref.registry import PROPAGATE, Backend, NonFinite
from fp8ref.spec import gemm, quant
from fp8ref.spec.bounds import Accumulation
from fp8ref.spec.quant import Quantized

#: The bug classes of docs/conformance.md ("Where kernels break"), plus the classes of the
#: original catalogue.
CLASSES = ("thresholds and tails", "static scales", "extreme-value position", "scale layouts", "format corners",
           "rounding count", "accumulation precision", "scales and values")


def segment_terms(a: Quantized, b: Quantized):
    """(A_seg fp32 codes, B_seg fp32 codes, sa fp32 [M], sb fp32 [N]) for each K-segment."""
    for k0, k1 in gemm.k_segments(a, b):
        yield (a.data[:, k0:k1].to(torch.float32), b.data[:, k0:k1].to(torch.float32),
               gemm.scale_column(a, k0).to(torch.float32), gemm.scale_column(b, k0).to(torch.float32))


def finish(y: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    """The epilogue: ``y`` plus the bias in ``y``'s dtype, one rounding to ``out_dtype``."""
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype)


def fp32_mm(a: Quantized, b: Quantized, bias, out_dtype, seg_sum=None, scale=None) -> torch.Tensor:
    """The correct fp32 pipeline, with hooks for the mutants: ``seg_sum(A, B) -> S`` and
    ``scale(S, sa, sb) -> scaled S``."""
    M, N = a.data.shape[0], b.data.shape[0]
    if a.data.shape[1] == 0:  # the spec's argument check (docs/spec.md: K = 0 is the caller's error)
        raise ValueError("a and b have 0 columns: the reduction dim K must be at least 1")
    y = torch.zeros(M, N, dtype=torch.float32)
    for A, B, sa, sb in segment_terms(a, b):
        S = A @ B.T if seg_sum is None else seg_sum(A, B)
        y += S * sa[:, None] * sb[None, :] if scale is None else scale(S, sa, sb)
    return finish(y, bias, out_dtype)


def products(A: torch.Tensor, B: torch.Tensor) -> np.ndarray:
    """Every product A[m, k] B[n, k] as a float32 ``[M, N, K]`` array (exact: 4-bit significands)."""
    return (A[:, None, :] * B[None, :, :]).numpy()


def sequential_sum(A: torch.Tensor, B: torch.Tensor, dtype=np.float32, reverse: bool = False) -> torch.Tensor:
    """sum_k A[:, k] B[:, k] one k at a time, the running sum rounded to ``dtype`` at every step
    (numpy's ``add.accumulate`` is a sequential loop in the array's dtype; ml_dtypes' bfloat16
    rounds each partial sum to bf16)."""
    p = products(A, B)
    if reverse:
        p = p[..., ::-1]
    if p.shape[-1] == 0:
        return torch.zeros(A.shape[0], B.shape[0])
    acc = np.add.accumulate(p.astype(dtype), axis=-1)[..., -1]
    return torch.from_numpy(acc.astype(np.float32))


def _truncate(v: np.ndarray, bits: int) -> np.ndarray:
    """float32 ``v`` truncated (toward zero) to a ``bits``-bit significand."""
    drop = 24 - bits
    return (v.view(np.int32) & np.int32(-(1 << drop))).view(np.float32)


def truncating_sum(A: torch.Tensor, B: torch.Tensor, bits: int, chunk: int | None = None) -> torch.Tensor:
    """sum_k A[:, k] B[:, k] with a ``bits``-bit truncating accumulator, sequential in K; with
    ``chunk``, every ``chunk`` products start a fresh accumulator and the chunk sums are added in
    fp32 (Hopper's promotion). Vectorized over rows, columns and chunks."""
    p = products(A, B)
    M, N, K = p.shape
    c = K if chunk is None else chunk
    n_chunks = max(1, math.ceil(K / c))
    pad = np.zeros((M, N, n_chunks * c - K), dtype=np.float32)
    p = np.concatenate([p, pad], axis=-1).reshape(M, N, n_chunks, c)
    acc = np.zeros((M, N, n_chunks), dtype=np.float32)
    for k in range(c):
        acc = _truncate(acc + p[..., k], bits)
    if n_chunks == 1:
        return torch.from_numpy(acc[..., 0].copy())
    return torch.from_numpy(np.add.accumulate(acc, axis=-1)[..., -1].copy())


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def reference_quantize(x, scheme, scale=None) -> Quantized:
    return quant.quantize(x, scheme, scale)


def static_divisor(x: torch.Tensor, scale: torch.Tensor, scheme) -> torch.Tensor:
    """The caller's static scale expanded to ``x``'s shape (fp32)."""
    rows, cols = x.shape
    s = scale.to(torch.float32).reshape(scheme.scale_shape(rows, cols))
    return quant.expand_scale(s, scheme, rows, cols)


class Fp32Base(Backend):
    """Correct: reference quantizer, fp32 scaled GEMM."""

    name = "correct-fp32-base"
    accumulation = Accumulation.FP32
    output_roundings = 1
    upstream = ""
    klass = ""
    bug = "the reference quantizer and an fp32 scaled GEMM (the base every other variant changes)"
    #: The ops a correct variant changes, which the self-test certifies it for (a variant that keeps
    #: the base's quantizer says ``GEMM_OPS``; the base is certified for everything).
    changes: tuple[str, ...] = ("quantize", "scaled_mm", "linear")
    #: The spec's answers, except the bias: the fp32 epilogue adds it as it is (NaN/Inf propagate).
    non_finite = NonFinite(bias=PROPAGATE)

    def quantize(self, x, scheme, scale=None):
        return reference_quantize(x, scheme, scale)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype)


#: What a variant that changes only the GEMM is certified for (its quantizer is the base's).
GEMM_OPS = ("scaled_mm", "linear")

__all__ = ["CLASSES", "GEMM_OPS", "Fp32Base", "finish", "fp32_mm", "segment_terms", "sequential_sum",
           "truncating_sum", "products", "bf16_round", "reference_quantize", "static_divisor", "ml_dtypes"]
