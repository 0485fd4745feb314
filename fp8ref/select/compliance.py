"""The compliance probe: a backend through the conformance contracts' checks at one case's shape,
before it may be timed.

``ProbeSet`` builds the problems once per case (adversarial rows from ``inputs.adversarial`` at
the shapes of ``probe_shapes``, as given problems of ``fp8ref.check.given``), shared by all
candidates, whose memos keep the reference's side; ``probe`` runs one backend through the
checking core's list ``fp8ref.check.probe.PROBE_CHECKS`` -- the contracts' own check functions,
so "compliant" means what a conformance certificate means, on fewer inputs. Nothing here compares
or bounds anything. A backend that fails the probe is never chosen, however fast.
"""

from __future__ import annotations

import math

import torch

from ..check.common import ContractViolation, Declined, backend_device
from ..check.given import GivenGemm, GivenLinear, GivenQuantize
from ..check.probe import PROBE_CHECKS, ProbeCheck
from ..registry import Backend, Case
from ..spec.quant import Quantized, quantize
from . import timing
from .decision import ProbeResult
from .inputs import adversarial
from .keys import m_bucket

__all__ = ["PROBE_ROWS", "PROBE_FULL_N_MAX", "PROBE_N_TILE", "PROBE_TIMED_CALLS", "ProbeSet", "probe", "probe_shapes"]

#: Probe: 16 rows (random + adversarial), fed to the backend in chunks of min(bucket, 16) rows.
PROBE_ROWS = 16
#: Probe columns: N itself up to this, else PROBE_N_TILE + N % PROBE_N_TILE (keeps N's residue
#: modulo every power-of-two tile width up to 256, so tail tiles are exercised) -- the float64
#: reference and bound at the full N of an LLM layer cost seconds.
PROBE_FULL_N_MAX = 512
PROBE_N_TILE = 256
#: The probe's estimate is the fastest of this many warm calls at the probe's shape.
PROBE_TIMED_CALLS = 3


def probe_shapes(case: Case) -> tuple[int, int]:
    """(rows per probe call, columns of the probe's weight) for ``case``."""
    mp = min(m_bucket(case.M), PROBE_ROWS)
    n_probe = case.N if case.N <= PROBE_FULL_N_MAX else PROBE_N_TILE + case.N % PROBE_N_TILE
    return mp, n_probe


class ProbeSet:
    """The probe's inputs and problems, built once per case and shared by all the candidates: the
    problems' memos keep the reference's side of every check (the bounds cost far more than a
    backend call)."""

    def __init__(self, case: Case, seed: int = 0):
        self.case = case
        self.mp, self.n_probe = probe_shapes(case)
        recipe, K = case.recipe, case.K
        gen = torch.Generator().manual_seed(seed)
        self.x = adversarial(PROBE_ROWS, K, recipe.activation, case.x_dtype, gen, outlier=300.0)
        w = adversarial(self.n_probe, K, recipe.weight, torch.float32, gen, outlier=30.0).to(torch.float64)
        w[PROBE_ROWS // 2:] /= math.sqrt(K)
        # Keep every output finite in out_dtype (fp16 tops out at 65504): scale the weight by a
        # power of two, which keeps its rounding ties ties (quantization is 2**k-equivariant).
        peak = float((self.x.to(torch.float64).abs() @ w.abs().T).max()) + 4.0
        limit = float(torch.finfo(case.out_dtype).max) / 16
        if peak > limit:
            w = w * 2.0 ** -math.ceil(math.log2(peak / limit))
        self.w = w.to(case.x_dtype)
        self.bias = torch.randn(self.n_probe, generator=gen).to(case.x_dtype) if case.has_bias else None
        self.qw = quantize(self.w, recipe.weight)
        self.chunks = [(r0, min(r0 + self.mp, PROBE_ROWS)) for r0 in range(0, PROBE_ROWS, self.mp)]
        act, dev = recipe.activation, case.device
        # One problem per op and chunk; their memos keep the reference's side (results, bounds per
        # declared accumulation) for every candidate probed with this set.
        self.problems: list[dict[str, GivenQuantize | GivenGemm | GivenLinear]] = [{
            "quantize": GivenQuantize(x=self.x[a:b], scheme=act, device=dev),
            "linear": GivenLinear(x=self.x[a:b], w=self.w, bias=self.bias, recipe=recipe, out_dtype=case.out_dtype,
                                  device=dev, qw=self.qw),
        } for a, b in self.chunks]
        # The GEMM's operands are given quantized, so one problem holds all the rows (the spec's
        # quantization of the 16 rows together) and the backend is called on the same chunks.
        self.whole: dict[str, GivenGemm] = {"scaled_mm": GivenGemm(
            a=quantize(self.x, act), b=self.qw, bias=self.bias, recipe=recipe, out_dtype=case.out_dtype,
            x_dtype=case.x_dtype, device=dev, call_rows=self.mp)}


def probe(backend: Backend, case: Case, *, seed: int = 0, _set: ProbeSet | None = None) -> ProbeResult:
    """Run ``backend`` through the conformance contracts' checks listed in
    ``fp8ref.check.probe.PROBE_CHECKS`` at ``case``'s shape, on random plus adversarial inputs, and
    time one warm call.

    The checks, each the contract of that name (``fp8ref conformance`` runs the same functions on
    its own problems; ``docs/selection.md``):

    1. ``quantize.scale`` and ``quantize.codes``: ``backend.quantize`` of the activations, the
       scale within ``scale_error_bound`` of the spec's and the codes within
       ``conforming_quantization_error_bound`` of x (from the spec's scale);
    2. ``scaled_mm.bound``: ``backend.scaled_mm`` of the spec's quantized activations and
       weight, within ``gemm_error_bound`` for the backend's declared accumulation and output
       roundings;
    3. ``linear.matches_two_calls``: ``backend.linear`` (the hook ``fp8ref.linear`` runs) returns
       the bits of ``scaled_mm(quantize(x))``;
    4. ``linear.bound``, for a backend with a fused ``linear`` of its own: within
       ``linear_error_bound`` of the float64 linear of the unquantized inputs (through the
       backend's own hook: ``fp8ref.linear`` is what is being selected for);
    5. ``linear.non_finite``, for a backend declaring ``rejects_non_finite``: NaN in x and in the
       bias raise ``ValueError``.

    Inputs: 16 activation rows (outlier channels, an all-zero row, rounding ties, huge dynamic
    range, a constant row, a single non-zero, +-qmax, random), fed in chunks of
    ``min(bucket(M), 16)`` rows so the backend runs at the bucket's own small M; a weight with
    outlier, all-zero and tie rows; a bias if the case has one. K is the case's K; N is the
    case's N up to 512, else ``256 + N % 256``. The probe stops at the first violation; a check
    that applies and is declined fails the probe (it cannot vouch for what it did not run).

    Returns
    -------
    ProbeResult
        ``compliant`` is True when every check held and nothing raised; ``ratios`` holds each
        check's worst error/bound by contract name, ``detail`` where the worst ratio or the
        violation was.

    Examples
    --------
    >>> import fp8ref
    >>> from fp8ref.select import probe
    >>> case = fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8)
    >>> probe(fp8ref.get_backend("reference"), case).compliant
    True
    """
    ps = ProbeSet(case, seed) if _set is None else _set
    elements = ps.mp * ps.n_probe
    checks = [c for c in PROBE_CHECKS if c.applies(backend)]
    ratios: dict[str, float] = {}
    worst, detail = 0.0, ""
    try:
        with backend_device(case.device):
            for c in checks:
                failed = False
                runs = (list(zip(ps.chunks, ps.problems, strict=True)) if c.rows == "each"
                        else [((0, PROBE_ROWS), ps.whole)] if c.rows == "all" else [(ps.chunks[0], ps.problems[0])])
                for rows, problems in runs:
                    ratio, failure = _run(c, backend, problems[c.op])
                    ratio = math.inf if failure and ratio <= 1.0 else ratio
                    ratios[c.name] = max(ratios.get(c.name, 0.0), ratio)
                    where = f"{c.name} on rows {rows[0]}:{rows[1]}"
                    if (failure and not failed) or ratio > worst:
                        worst = ratio
                        detail = f"{where}: {failure}" if failure else f"worst: {where}, error/bound {ratio:.3g}"
                    failed = failed or bool(failure)
                # The first check violated decides (at its worst chunk): later ones would judge its echo.
                if failed:
                    return ProbeResult(False, worst, detail, math.inf, elements, ratios)
        # The warm call a plan makes (the checks' calls compiled or autotuned it), the fastest of
        # PROBE_TIMED_CALLS: the basis of the estimate that lets the timing skip backends that
        # cannot win. One call alone read up to 5x a backend's steady time (docs/selection.md).
        prepared = backend.prepare_weight(_to_device(ps.qw, case.device))
        bias_d = None if ps.bias is None else ps.bias.to(case.device)
        xc_d = ps.x[ps.chunks[0][0]:ps.chunks[0][1]].to(case.device)
        call = timing.warm_call(backend, prepared, xc_d, bias_d, case.out_dtype, case.recipe.activation)
        warm_t = math.inf
        for _ in range(PROBE_TIMED_CALLS):
            timing.sync(case.device)
            t0 = timing.clock()
            call()
            timing.sync(case.device)
            warm_t = min(warm_t, timing.clock() - t0)
    except Exception as exc:  # a backend that raises on valid input at its own declared case fails
        return ProbeResult(False, math.inf, f"raised {type(exc).__name__}: {exc}", math.inf, elements,
                           {c.name: math.inf for c in checks})
    return ProbeResult(True, worst, detail, warm_t, elements, ratios)


def _run(c: ProbeCheck, backend: Backend, problem) -> tuple[float, str]:
    """``(ratio, "")`` when ``c`` holds on ``problem``; ``(ratio, why)`` when it does not (a
    violation's ratio, inf for a structural one; a check that applies and is declined fails: the
    probe cannot vouch for what it did not run)."""
    try:
        ratio = c.check(backend, problem)
    except ContractViolation as exc:
        return (math.inf if exc.ratio is None else exc.ratio), str(exc)
    except Declined as exc:
        return math.inf, f"declined the probe's problem: {exc}"
    return (0.0 if ratio is None else ratio), ""


def _to_device(q: Quantized, device: str) -> Quantized:
    if q.data.device == torch.device(device):
        return q
    return Quantized(q.data.to(device), q.scale.to(device), q.scheme, q.n_saturated)
