"""Every conformance contract, in one table (``CONTRACTS``) that the driver iterates.

Each row names the op it checks, its kind and its bound:

* ``exact``   -- the backend must produce these bits (identities that hold for any conforming
  implementation, e.g. determinism, sign symmetry, lossless quantization of grid values);
* ``bounded`` -- the error against the reference is within a bound from ``fp8ref.spec.bounds``;
* ``probe``   -- a crafted, deterministic measurement compared with the backend's declaration;
* ``info``    -- a characteristic reported as yes/no, never a failure (batch invariance,
  bit-exact quantization).

A check function takes ``(backend, problem)`` and returns the worst error/bound ratio it saw (or
None), raises ``ContractViolation`` with the worst element located, or raises ``Declined`` when
the backend declines the case (or the case lies outside the contract's premise); the driver
then draws another example.

Every contract of an op first runs that op's corner sweep (``sweep.py``), through the contract's
``sweep`` adapter where it needs one (a power of two for the equivariance contracts, grid values
for the lossless one), then the Hypothesis search of its ``strategy``.

The table lives here; the checks live in one module per op (``quantize``, ``scaled_mm``,
``linear``), on top of ``common`` (the ``Contract`` row, ``Declined``/``ContractViolation``, calls
into a backend, comparisons, the reference cache). Imports flow down: ``__init__`` imports the
per-op modules, they import ``common``; all of them import only the registry, the spec and the
conformance modules below them (``strategies``, ``profiles``, ``scope``, ``sweep``).
"""

from __future__ import annotations

import torch

from .. import strategies as fst
from ..sweep import with_k
from .calling import (
    check_degenerate,
    check_layout,
    check_lifetime,
    check_non_finite,
    check_size_limits,
    check_threads,
    check_untouched,
    size_problems,
    size_sweep,
)
from .common import Contract, ContractViolation, Declined, backend_threads, poison_allocator, reference_threads
from .linear import check_linear_bound, check_linear_matches_two_calls
from .quantize import (
    check_quantize_bit_exact,
    check_quantize_codes,
    check_quantize_deterministic,
    check_quantize_exact_on_pow2_scale,
    check_quantize_lossless,
    check_quantize_scale,
    check_quantize_scale_equivariance,
    check_quantize_sign_symmetry,
)
from .scaled_mm import (
    check_accumulator_bits,
    check_scaled_mm_all_written,
    check_scaled_mm_batch_invariant,
    check_scaled_mm_bound,
    check_scaled_mm_deterministic,
    check_scaled_mm_finite,
    check_scaled_mm_scale_equivariance,
    check_scaled_mm_sign_symmetry,
    declared_bits,
)

__all__ = ["Contract", "ContractViolation", "Declined", "CONTRACTS", "CONTRACT_NAMES", "CALLING_DIMENSIONS",
           "CALLING_CONTRACT_NAMES", "get_contract",
           "declared_bits", "poison_allocator", "reference_threads", "backend_threads",
           "check_linear_matches_two_calls"]


# --------------------------------------------------------------------------------------------
# pinned examples

_f32, _f16, _bf16 = torch.float32, torch.float16, torch.bfloat16
_QS = fst.QuantScheme
_Q_EX = (
    fst.QuantizeProblem(17, 40, _f16, _QS(granularity="tensor"), fst.TensorSpec("normal", 0, 1)),  # fp16, M % 16
    fst.QuantizeProblem(3, 24, _f32, _QS(amax_floor=0.0), fst.TensorSpec("zero_rows", 0, 2)),  # zero rows, no floor
    fst.QuantizeProblem(2, 8, _f32, _QS(amax_floor=0.0), fst.TensorSpec("normal", -130, 3)),  # tiny scales
    fst.QuantizeProblem(4, 32, _bf16, _QS(), fst.TensorSpec("ties", -3, 4)),  # RNE ties
    fst.QuantizeProblem(5, 160, _bf16, _QS(), fst.TensorSpec("outliers", 0, 5)),  # per-token amax spread
)
_Q_GRID_EX = (fst.QuantizeProblem(5, 33, _bf16, _QS(granularity="group", group_size=16),
                                  fst.TensorSpec("on_grid", -2, 5)),
              fst.QuantizeProblem(3, 16, _f32, _QS(), fst.TensorSpec("ties", 1, 6)))
_G_EX = (
    # M not a multiple of 16, K % 128 != 0, bias, fp32 output: tails, dropped K blocks, bias, scales
    fst.GemmProblem(17, 16, 144, fst.RECIPES["w8a8_fp8"], _f32, fst.CodeSpec("bits", 1, -9, False),
                    fst.CodeSpec("bits", 2, -9, False), True, 3),
    # codes at +-qmax: overflow of narrow intermediates
    fst.GemmProblem(4, 16, 32, fst.RECIPES["fp8"], _bf16, fst.CodeSpec("extremes", 4, -9, True),
                    fst.CodeSpec("extremes", 5, -9, True)),
    # E4M3FNUZ at M = N = 1 and 16 x 16: torch._scaled_mm (2.13 CPU) raises here on some CPUs (the
    # ledger's torch-cpu-scaled-mm-fnuz), a failure a random seed met only now and then (issue 10);
    # pinned so it is always run
    fst.GemmProblem(1, 1, 16, fst.RECIPES["w8a8_fp8_rocm"], _bf16, fst.CodeSpec("bits", 6, -9, True),
                    fst.CodeSpec("bits", 7, -9, True)),
    fst.GemmProblem(16, 16, 32, fst.RECIPES["w8a8_fp8_rocm"], _f32, fst.CodeSpec("bits", 8, -9, False),
                    fst.CodeSpec("bits", 9, -9, False), True, 10),
)
_L_EX = (fst.LinearProblem(17, 16, 160, fst.RECIPES["w8a8_fp8"], _bf16, _f32, fst.TensorSpec("outliers", 0, 6),
                           fst.TensorSpec("normal", -4, 7), True),
         fst.LinearProblem(1, 1, 16, fst.RECIPES["w8a8_fp8_rocm"], _bf16, _bf16, fst.TensorSpec("normal", 0, 8),
                           fst.TensorSpec("normal", 0, 9)),
         fst.LinearProblem(16, 16, 16, fst.RECIPES["w8a8_fp8_rocm"], _f16, _f32, fst.TensorSpec("normal", 0, 10),
                           fst.TensorSpec("normal", -3, 11), True))


def _with_k(examples, k):
    from dataclasses import replace

    return tuple(replace(e, k=k) for e in examples)


# --------------------------------------------------------------------------------------------
# the table

_Q = "quantize"
_G = "scaled_mm"


def _qp(**kw):
    return lambda prof, scope=None: fst.quantize_problems(prof, scope=scope, **kw)


def _gp(**kw):
    return lambda prof, scope=None: fst.gemm_problems(prof, scope=scope, **kw)


def _lp(prof, scope=None):
    return fst.linear_problems(prof, scope=scope)


def _on_grid(problems: list) -> list:
    """The sweep's quantize problems with their values moved onto the grid (the lossless premise);
    a static scale then a power of two (2**exp: the grid's own scale)."""
    from dataclasses import replace

    return [replace(p, x=fst.TensorSpec("on_grid", p.x.exp, p.x.seed), static="pow2") for p in problems]


def _pow2_premise(problems: list) -> list:
    """The sweep's quantize problems moved onto the premise of a power-of-two scale: static schemes
    take power-of-two scales (rounded up, or down: up to 2x saturation), dynamic ones keep
    pow2_scale and grid families (scale 2**exp) and otherwise move to a grid family on the same
    shape and scheme (ties, subnormals and values rounding to zero, +-qmax, grid values)."""
    from dataclasses import replace

    out = []
    for i, p in enumerate(problems):
        if not p.scheme.dynamic:
            out.append(replace(p, static=("pow2", "pow2_low")[i % 2]))
        elif p.scheme.pow2_scale or p.x.family in fst.GRID_FAMILIES:
            out.append(p)
        else:
            fam = ("ties", "underflow", "qmax", "on_grid")[i % 4]
            out.append(replace(p, x=fst.TensorSpec(fam, p.x.exp, p.x.seed)))
    return out


def _few_rows(problems: list) -> list:
    """Problems with at most 129 rows (batch invariance recomputes rows one by one)."""
    return [p for p in problems if p.M <= 129]


def _thin(problems: list) -> list:
    """Every sixteenth sweep problem: the calling contracts call the backend several times per
    problem and judge how it is called, which the sweep's values vary little."""
    return problems[::16]


def _small(strategy):
    """``strategy`` on shapes of at most 17 x 80 (the calling contracts' search: many calls per
    problem; the size limits and the degenerate shapes have contracts of their own)."""
    return lambda prof, scope=None: strategy(prof.with_(max_mn=min(prof.max_mn, 17), max_k=min(prof.max_k, 80),
                                                        max_elems=min(prof.max_elems, 1360),
                                                        max_rows=min(prof.max_rows, 17), large_rows=(), long_k=()),
                                             scope)


#: Search examples of each calling contract (after its share of the sweep, every sixteenth problem).
CALLING_SEARCH = 4

#: The calling contract (docs/spec.md, "The calling contract"): per dimension, its statement and check.
_CALLING = (
    ("layout", "every argument as a view (transposed, offset storage, row/column stride 2, stride 0): the "
     "contiguous call's bits, or within the op's bound, or a ValueError/TypeError refusal", "bit-exact or bound",
     check_layout),
    ("untouched", "no call modifies an argument or the prepared weight (bits compared after every call), and "
     "no output shares storage with them", "bit-exact", check_untouched),
    ("lifetime", "arguments and the weight object updated in place (copy_, mul_, item assignment, .data =, "
     "a numpy view) give what a fresh call on the new values gives: no stale internal copy", "bit-exact",
     check_lifetime),
    ("threads", f"{4} threads calling at once, each on its own values, get the bits of the same call made alone, "
     "or else results within the op's bound of the spec on their own values", "bit-exact or the op's bound",
     check_threads),
    ("non_finite", "NaN/Inf in each input: a ValueError or non-finite outputs wherever they depend on it "
     "(undeclared: either; Backend.non_finite narrows it to one); results past the output dtype's range are "
     "+-Inf; never a finite stand-in", "defect; narrowed by the declaration", check_non_finite),
    ("degenerate", "M, N, K = 1: within the bound; M or N = 0: an empty result; K = 0: a ValueError or "
     "TypeError, or the empty sum (the bias rounded to the output dtype, else zeros); never another value or "
     "a crash", "bound / shape", check_degenerate),
)
_OP_STRATEGY = {"quantize": _qp(), "scaled_mm": _gp(), "linear": _lp}
_CALLING_CONTRACTS = tuple(
    Contract(f"{op}.{dim}", op, "exact" if dim != "degenerate" else "bounded", statement, bound,
             _small(_OP_STRATEGY[op]), check, (), _thin, secondary=True, search_examples=CALLING_SEARCH)
    for dim, statement, bound, check in _CALLING for op in ("quantize", "scaled_mm", "linear")
) + tuple(
    Contract(f"{op}.size_limits", op, "bounded",
             "rows (and N) past 65535, K past 2**16 (profile limits: operands past 2**31 elements): within the "
             "op's bound, or declined in supports", "the op's bound", size_problems(_OP_STRATEGY[op], op),
             check_size_limits, (), size_sweep(op))
    for op in ("quantize", "scaled_mm", "linear")
)

CONTRACTS: tuple[Contract, ...] = (
    # Bounded and exact-value contracts first: with fail_fast, a broken backend is rejected early.
    Contract("scaled_mm.accumulator_bits", _G, "probe",
             "the accumulator keeps at least the bits the declared accumulation promises (-log2 u)",
             "accumulator_bits probe", None, check_accumulator_bits),
    Contract("quantize.codes", _Q, "bounded",
             "|codes * scale - x| within the quantization bound, no NaN code, |codes| <= qmax",
             "conforming_quantization_error_bound", _qp(), check_quantize_codes, _Q_EX, exhaustive=True),
    Contract("quantize.scale", _Q, "bounded",
             "dynamic scale = max(amax, floor)/qmax within 1 ulp of scale_dtype (pow2 scales: exact); a static "
             "scheme returns the caller's scale", "scale_interval (1 ulp of scale_dtype)", _qp(), check_quantize_scale,
             _Q_EX, exhaustive=True),
    Contract("scaled_mm.bound", _G, "bounded",
             "|y - y_ref| within the bound of the declared accumulation and output roundings",
             "gemm_error_bound", _gp(), check_scaled_mm_bound, _G_EX),
    Contract("linear.bound", "linear", "bounded",
             "quantize x and w, scaled_mm: within the end-to-end bound of the unquantized float64 linear",
             "linear_error_bound", _lp, check_linear_bound, _L_EX),
    Contract("linear.matches_two_calls", "linear", "exact",
             "the fused Backend.linear hook (and a bound warm call, Backend.bind_linear and "
             "bind_watched_linear) returns scaled_mm(quantize(x)) bit for bit; a watched call returns None "
             "for rows outside its watch, a changed sampled weight byte and a moved version",
             "bit-exact", _lp, check_linear_matches_two_calls, _L_EX, secondary=True,
             requires=("quantize", "scaled_mm")),
    Contract("quantize.exact_on_pow2_scale", _Q, "exact",
             "where the scale is a power of two (x/s exact), the codes are RNE(clamp(x/s)): ties to even, "
             "subnormals kept, saturation at qmax, never -0 in a format without it", "bit-exact values",
             _qp(), check_quantize_exact_on_pow2_scale, _Q_GRID_EX, _pow2_premise),
    Contract("scaled_mm.all_written", _G, "exact",
             "every output element is written (output memory poisoned with NaN, then with a finite value)",
             "bit-exact", _gp(), check_scaled_mm_all_written, _G_EX),
    Contract("scaled_mm.finite", _G, "exact", "no NaN/Inf from finite operands whose exact result fits out_dtype",
             "finite", _gp(), check_scaled_mm_finite, _G_EX),
    Contract("quantize.lossless_on_grid", _Q, "exact",
             "inputs already on the FP8 grid (scale 2**e) quantize losslessly, scale equal to the reference",
             "bit-exact", _qp(families=("on_grid", "qmax", "ties")), check_quantize_lossless, _Q_GRID_EX,
             _on_grid, secondary=True),
    Contract("quantize.deterministic", _Q, "exact", "the same call twice gives the same bits",
             "bit-exact", _qp(), check_quantize_deterministic, _Q_EX, secondary=True),
    Contract("quantize.scale_equivariance", _Q, "exact",
             "x*2**k gives the same codes and scale*2**k (a stored multiplier: *2**-k; where the spec itself is "
             "equivariant)",
             "bit-exact", _qp(with_k=True), check_quantize_scale_equivariance, _with_k(_Q_EX, 3), with_k,
             secondary=True),
    Contract("quantize.sign_symmetry", _Q, "exact", "-x gives -codes and the same scale",
             "bit-exact", _qp(), check_quantize_sign_symmetry, _Q_EX, secondary=True),
    Contract("scaled_mm.deterministic", _G, "exact", "the same call twice gives the same bits",
             "bit-exact", _gp(), check_scaled_mm_deterministic, _G_EX, secondary=True),
    Contract("scaled_mm.sign_symmetry", _G, "exact", "scaled_mm(-a, b, -bias) = -scaled_mm(a, b, bias)",
             "bit-exact", _gp(), check_scaled_mm_sign_symmetry, _G_EX, secondary=True),
    Contract("scaled_mm.scale_equivariance", _G, "exact",
             "a.scale*2**k and bias*2**k give y*2**k (away from subnormals and overflow)",
             "bit-exact; where an fp32 product can underflow (the underflow term of docs/spec.md 5.2), "
             "B2 + |r2 - 2**k r1| + 2**k B1", _gp(with_k=True), check_scaled_mm_scale_equivariance,
             _with_k(_G_EX, 2), with_k, secondary=True),
    Contract("scaled_mm.batch_invariant", _G, "info",
             "row i computed alone equals row i of the batch (reported yes/no, never a failure)",
             "bit-exact", _gp(), check_scaled_mm_batch_invariant, _G_EX, _few_rows, secondary=True),
    Contract("quantize.bit_exact", _Q, "info",
             "codes and scales are the reference's bits (reported yes/no; the contract is quantize.codes)",
             "bit-exact", _qp(), check_quantize_bit_exact, _Q_EX, secondary=True),
) + _CALLING_CONTRACTS

CONTRACT_NAMES: tuple[str, ...] = tuple(c.name for c in CONTRACTS)
#: The dimensions of the calling contract, in table order; each has a contract per op (``<op>.<dimension>``).
CALLING_DIMENSIONS: tuple[str, ...] = tuple(d for d, *_ in _CALLING) + ("size_limits",)
CALLING_CONTRACT_NAMES: tuple[str, ...] = tuple(c.name for c in _CALLING_CONTRACTS)


def get_contract(name: str) -> Contract:
    """The contract called ``name`` (KeyError listing the names otherwise)."""
    for c in CONTRACTS:
        if c.name == name:
            return c
    raise KeyError(f"no contract named {name!r}; contracts: {list(CONTRACT_NAMES)}")
