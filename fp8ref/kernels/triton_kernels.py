"""The ``triton`` backend: Triton kernels for dynamic FP8 activation quantization and scaled GEMM.

Kernels (defined on first use, so ``TRITON_INTERPRET`` is read then, not at import):

``quantize``
    One program per (tile of rows, group), the tile at most ``_MAX_TILE`` elements per step (a
    program per row made the interpreter pay milliseconds per row): per row, amax over the group
    in fp32, ``s = max(amax, floor) / qmax``
    with a correctly rounded division (``div_rn``), ``v = div_rn(x, s)``, clamp, and the
    round-to-nearest-even to E4M3FN done with *integer* operations on the fp32 bit pattern
    (``_rne_e4m3_bits``). Per-token is one group of width K, per-group 1 x G; per-tensor gets its
    scale from a torch amax and runs the same kernel with that scale. Codes are bit-identical to
    ``fp8ref.quantize``. Non-finite inputs are counted in the kernel and raise ``ValueError``.
``scaled_mm``
    ``tl.dot`` on FP8 operands into an fp32 accumulator, scales and bias applied in fp32, the fp32
    result rounded once to ``out_dtype`` by torch. Tensor-wise or per-row scales on either side,
    and K-segmented scales (1 x C activation groups, R x C weight blocks, C a power of two in
    [16, 256], e.g. DeepSeek's 1 x 128 / 128 x 128): one dot per segment, scaled and summed in fp32.

Why integer rounding and an fp32 store: Triton's CPU interpreter (``TRITON_INTERPRET=1``, how CI
runs these kernels) casts fp32 to float8e4nv with wrong rounding (triton-lang/triton#8322) and
truncates bf16 stores; see ``fp8ref/conformance/known_failures.py``. ``tl.dot`` on FP8 operands with an
fp32 result is right there.

Declared accumulation: fp32 under the interpreter (numpy fp32). On CUDA, ``tl.dot`` on FP8 is
run with ``max_num_imprecise_acc=0`` -- on Hopper the partial sum of each wgmma (K = 32) is added
into an fp32 accumulator -- but the tensor core's own accumulation inside one instruction keeps
about 14 bits (DeepSeek-V3 report, 3.3.2), so on CUDA it declares u = 2**-13 with promotion
every 32: the ``fast`` class until a GPU run measures better.
"""

from __future__ import annotations

import os
import threading
from contextlib import nullcontext
from dataclasses import replace

import torch

from ..registry import RAISE, SPEC_NON_FINITE, Backend, Case, NonFinite, register_backend
from ..spec.bounds import Accumulation
from ..spec.formats import E4M3FN
from ..spec.gemm import OUT_DTYPES
from ..spec.quant import Quantized, check_float_input
from ..spec.schemes import Granularity, QuantScheme
from ._common import bias_fp32, check_mm_args, empty_result, fast_quantize, ieee_methods, standard_scale, unwrap

__all__ = ["TritonBackend", "triton_quantize", "triton_scaled_mm", "interpreting", "CUDA_ACCUMULATION",
           "rne_e4m3_reference"]

#: What ``tl.dot`` on FP8 with max_num_imprecise_acc=0 is declared to do on a CUDA device.
CUDA_ACCUMULATION = Accumulation("fp8-tc-promote32", 2.0**-13, promote_every=32)

_MAX_CHUNK = 1024  #: columns a quantize program loads at once
_MAX_TILE = 4096  #: elements (rows x columns) a quantize program loads at once
_SEG_WIDTHS = (16, 32, 64, 128, 256)


def interpreting() -> bool:
    """True when Triton will run kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return f"triton is not importable: {exc!r}"
    return None


def rne_e4m3_reference(v: torch.Tensor) -> torch.Tensor:
    """The kernel's integer rounding, written with torch int ops (for tests and as documentation).

    ``v`` is fp32 already clamped to [-448, 448]; returns the E4M3FN codes as uint8. With
    e = unbiased exponent of |v| and m its 24-bit significand (implicit bit set), the code's
    significand is r = RNE(m / 2**sh) with sh = max(20, 14 - e): 20 keeps 3 fraction bits of a
    normal, 14 - e aligns a subnormal to the 2**-9 grid; a carry out of r lands in the exponent
    field because code = ((max(e, -6) + 6) << 3) + r.
    """
    bits = v.contiguous().view(torch.int32).to(torch.int64)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    e = (a >> 23) - 127
    m = (a & 0x7FFFFF) | 0x800000
    sh = torch.clamp(torch.clamp(14 - e, min=20), max=25)
    r = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    r = r + ((rem > half) | ((rem == half) & ((r & 1) == 1))).to(torch.int64)
    code = ((torch.clamp(e, min=-6) + 6) << 3) + r
    return (code | (sign << 7)).to(torch.uint8)


def _kernels():
    """The jit kernels, imported on first use (triton reads TRITON_INTERPRET at that moment)."""
    from . import _triton_defs

    return _triton_defs


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def _quant_reason(scheme: QuantScheme) -> str | None:
    if scheme.format != E4M3FN:
        return f"the triton quantize kernel rounds to e4m3fn only, not {scheme.format.name}"
    if not scheme.dynamic:
        return "the triton quantize kernel computes dynamic scales only"
    if scheme.scale_dtype != torch.float32 or scheme.pow2_scale or not scheme.standard_scale_rule:
        return "the triton quantize kernel stores plain fp32 scales (no pow2_scale, scale_dtype float32)"
    if scheme.granularity is Granularity.BLOCK:
        return "the triton quantize kernel does per-tensor, per-row and 1 x G groups, not R x C blocks"
    return None


#: Triton's CPU interpreter keeps the launch's grid in module state: two threads launching at once
#: read each other's grid (``y >= grid_dim[1]``) or lose the JIT context; launches there take turns.
_INTERPRETER_LOCK = threading.Lock()
# A lock another thread held at a fork stays held for ever in the child: the child gets fresh ones.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: globals().update(_INTERPRETER_LOCK=threading.Lock()))


def _launching():
    """The context a kernel launch runs in: the interpreter's lock under the interpreter, else nothing."""
    return _INTERPRETER_LOCK if interpreting() else nullcontext()


def triton_quantize(x: torch.Tensor, scheme: QuantScheme) -> Quantized:
    """Quantize ``x`` [rows, cols] with the Triton kernel (schemes per ``_quant_reason``).

    Examples
    --------
    >>> import os; os.environ.setdefault("TRITON_INTERPRET", "1")
    '1'
    >>> import torch, fp8ref
    >>> from fp8ref.kernels.triton_kernels import triton_quantize
    >>> x = torch.randn(3, 40)
    >>> q = triton_quantize(x, fp8ref.QuantScheme())
    >>> torch.equal(q.data.view(torch.uint8), fp8ref.quantize(x).data.view(torch.uint8))
    True
    """
    reason = _quant_reason(scheme)
    if reason:
        raise ValueError(reason)
    check_shape = (isinstance(x, torch.Tensor) and x.layout is torch.strided and not x.is_nested
                   and x.device.type != "meta" and x.dim() == 2
                   and x.dtype in (torch.float32, torch.bfloat16, torch.float16))
    if not check_shape or x.numel() == 0:
        check_float_input(x)  # raises for the wrong type/layout/shape; handles the empty case below
        return fast_quantize(x, scheme)
    k = _kernels()
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, cols = x.shape
    g = scheme.granularity
    static = g is Granularity.TENSOR
    if static:
        amax = x.abs().amax().to(torch.float32)
        if not bool(torch.isfinite(amax)):
            check_float_input(x)
        s = standard_scale(amax, scheme.qmax, scheme.amax_floor).reshape(1, 1)
        G, n_groups = cols, 1
    else:
        G = cols if g is Granularity.ROW else scheme.group_size
        n_groups = -(-cols // G)
        s = torch.empty(rows, n_groups, dtype=torch.float32, device=x.device)
    q = torch.empty(rows, cols, dtype=torch.uint8, device=x.device)
    bad = torch.empty(rows, n_groups, dtype=torch.int32, device=x.device)
    block = _pow2_at_least(min(G, cols), 16, _MAX_CHUNK)
    tile_rows = _pow2_at_least(rows, 1, max(1, _MAX_TILE // block))
    with _launching():
        k._quant_kernel[(-(-rows // tile_rows), n_groups)](
            x, q, s, bad, rows, cols, G, n_groups, x.stride(0), q.stride(0), scheme.qmax, scheme.amax_floor,
            float(torch.finfo(torch.float32).tiny), STATIC=static, ROWS=tile_rows, BLOCK=block)
    if bool(bad.any()):
        check_float_input(x)
    return Quantized(q.view(scheme.format.torch_dtype), s, scheme, 0)


def _segment_width(a: Quantized, b: Quantized) -> tuple[int | None, str | None]:
    """The K-segment width C the GEMM kernel iterates with, None for one segment, or a reason."""
    K = a.data.shape[1]
    widths = set()
    for q in (a, b):
        _, c = q.scheme.block_shape(*q.data.shape)
        if c < K:
            widths.add(c)
    if not widths:
        return None, None
    if len(widths) > 1:
        return None, f"the triton GEMM needs one K-block width for both operands, got {sorted(widths)}"
    c = widths.pop()
    if c not in _SEG_WIDTHS:
        return None, f"the triton GEMM takes K-blocks of {_SEG_WIDTHS}, not {c}"
    return c, None


def _scale_strides(q: Quantized) -> tuple[torch.Tensor, int, int, int]:
    """(fp32 scale, row stride, K-block stride, rows per scale) as the kernel indexes them."""
    s = q.scale.to(torch.float32).contiguous()
    rows, cols = q.data.shape
    r, _ = q.scheme.block_shape(rows, cols)
    g = q.scheme.granularity
    if g is Granularity.TENSOR:
        return s, 0, 0, 1
    sk = s.stride(1) if s.shape[1] > 1 else 0  # one K-block: every segment reads column 0
    return s, s.stride(0), sk, r if g is Granularity.BLOCK else 1


def triton_scaled_mm(a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(a . b^T) (.) scales + bias`` with the Triton GEMM kernel (fp32 result rounded once)."""
    check_mm_args(a, b, bias, out_dtype)
    for q, what in ((a, "a"), (b, "b")):
        if q.scheme.format != E4M3FN:
            raise ValueError(f"the triton GEMM takes e4m3fn operands; {what} is {q.scheme.format.name}")
    seg, reason = _segment_width(a, b)
    if reason:
        raise ValueError(reason)
    empty = empty_result(a, b, out_dtype)
    if empty is not None:
        return empty
    if interpreting():  # the interpreter decodes E4M3FN's NaN codes (0x7F, 0xFF) as numbers: refuse them
        for q, what in ((a, "the activations"), (b, "the weight")):
            if bool(((q.data.view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise ValueError(f"{what} hold NaN codes; the triton GEMM under the interpreter does not propagate NaN")
    k = _kernels()
    M, K = a.data.shape
    N = b.data.shape[0]
    out = torch.full((M, N), float("nan"), dtype=torch.float32, device=a.data.device)
    ad = a.data if a.data.stride(1) == 1 else a.data.contiguous()
    bd = b.data if b.data.stride(1) == 1 else b.data.contiguous()
    sa, sa_sm, sa_sk, _ = _scale_strides(a)
    sb, sb_sn, sb_sk, b_rows = _scale_strides(b)
    b32 = bias_fp32(bias, ad.device)
    block_k = seg if seg else _pow2_at_least(K, 16, 128)
    block_m = _pow2_at_least(M, 16, 64)
    block_n = _pow2_at_least(N, 16, 64)
    grid = (-(-M // block_m), -(-N // block_n))
    with _launching():
        k._mm_kernel[grid](ad, bd, sa, sb, b32 if b32 is not None else out, out, M, N, K,
                   ad.stride(0), bd.stride(0), out.stride(0), sa_sm, sa_sk, sb_sn, sb_sk, b_rows,
                   HAS_BIAS=b32 is not None, SEGMENTED=seg is not None,
                   BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.to(out_dtype)


@ieee_methods
class TritonBackend(Backend):
    """Triton kernels for quantization and the scaled GEMM (see the module docstring).

    Examples
    --------
    >>> import os; os.environ.setdefault("TRITON_INTERPRET", "1")
    '1'
    >>> import torch, fp8ref
    >>> be = fp8ref.get_backend("triton")
    >>> qx = be.quantize(torch.randn(4, 32), fp8ref.W8A8_FP8.activation)
    >>> qw = fp8ref.quantize(torch.randn(16, 32), fp8ref.W8A8_FP8.weight)
    >>> be.scaled_mm(qx, qw).shape
    torch.Size([4, 16])
    """

    name = "triton"
    output_roundings = 1
    rejects_non_finite = True  # the spec's checks: x via the quantizer, bias via check_mm_args

    @property
    def conformance_max_elems(self) -> int | None:
        """Element budget hint for the conformance suite: the interpreter runs each program in
        Python (milliseconds per quantization group), so it certifies on smaller operands (reports
        say so)."""
        return 1024 if interpreting() else None

    @property
    def conformance_max_examples(self) -> int | None:
        """Example-count hint for the conformance suite under the interpreter (a count, not a time,
        so the ci profile's verdicts do not depend on the machine): at most 8 drawn examples per
        contract besides the pinned ones and the corner sweep, each a large fraction of a second of
        CPU for a quantize contract (the ci profile's own count for per-element backends, 4, is
        lower and wins; docs/performance.md, "Figures behind the code")."""
        return 8 if interpreting() else None

    @property
    def bench_skip_reason(self) -> str | None:
        """Why ``fp8ref bench`` leaves this backend out by default: under the interpreter every
        program runs as numpy in Python, a correctness vehicle whose times say nothing about the
        kernel (minutes per call at benchmark shapes: docs/performance.md, "Figures behind the
        code")."""
        return ("it runs in Triton's CPU interpreter (TRITON_INTERPRET=1): Python, minutes per call at "
                "benchmark shapes, and its times say nothing about the kernel") if interpreting() else None

    @property
    def accumulation(self) -> Accumulation:  # type: ignore[override]
        if torch.cuda.is_available() and not interpreting():
            return CUDA_ACCUMULATION
        return Accumulation.FP32

    def available(self) -> str | None:
        err = _import_error()
        if err:
            return err
        if not torch.cuda.is_available() and not interpreting():
            return ("no CUDA device, and TRITON_INTERPRET is not 1 (set it before triton is first used "
                    "to run the kernels in Triton's CPU interpreter)")
        return None

    def supports(self, case: Case) -> str | None:
        dev = torch.device(case.device).type
        if dev == "cpu" and not interpreting():
            return "CPU tensors need TRITON_INTERPRET=1 (Triton compiles for GPUs only)"
        if dev == "cuda" and not torch.cuda.is_available():
            return "case is on CUDA but torch.cuda.is_available() is False"
        if dev == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability() < (8, 9):
            return "tl.dot on FP8 operands needs CUDA capability >= 8.9"
        if dev not in ("cpu", "cuda"):
            return f"triton backend runs on cpu (interpreter) or cuda, not {dev}"
        if case.out_dtype not in OUT_DTYPES:
            return f"out_dtype {case.out_dtype} is not one of {OUT_DTYPES}"
        act, wt = case.recipe.activation, case.recipe.weight
        reason = _quant_reason(act)
        if reason:
            return f"activation scheme {act.short_str()}: {reason}"
        if case.op == "quantize":
            return None
        if wt.format != E4M3FN:
            return f"the triton GEMM takes e4m3fn weights, not {wt.format.name}"
        widths = set()
        for s, rows in ((act, case.M), (wt, case.N)):
            _, c = s.block_shape(rows, case.K)
            if c < case.K:
                widths.add(c)
        if len(widths) > 1:
            return f"the triton GEMM needs one K-block width for both operands, got {sorted(widths)}"
        if widths and widths.pop() not in _SEG_WIDTHS:
            return f"the triton GEMM takes K-blocks of {_SEG_WIDTHS}"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        if scale is not None:
            raise ValueError(f"backend {self.name!r}: the triton quantize kernel computes dynamic scales only")
        return triton_quantize(x, scheme)

    @property
    def non_finite(self) -> NonFinite:
        """The spec's answers, except NaN codes under the interpreter: it decodes E4M3FN's 0x7F and
        0xFF as numbers, so ``scaled_mm`` scans the codes there and raises."""
        return replace(SPEC_NON_FINITE, codes=RAISE) if interpreting() else SPEC_NON_FINITE

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        b, _ = unwrap(b, self.name)
        return triton_scaled_mm(a, b, bias, out_dtype)


register_backend(TritonBackend())
