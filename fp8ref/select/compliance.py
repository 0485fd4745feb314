"""The compliance probe: a backend against the spec's bounds at one case's shape, before it may be timed.

``ProbeSet`` builds the inputs (``inputs.adversarial``) and the reference's side of every check
once per case, shared by all candidates; ``probe`` runs one backend through them. A backend that
fails the probe is never chosen, however fast.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..registry import Backend, Case
from ..spec import bounds
from ..spec.compare import compare, compare_bits
from ..spec.gemm import scaled_mm
from ..spec.quant import Quantized, dequantize, quantize
from ..spec.schemes import Granularity, QuantScheme
from . import timing
from .decision import ProbeResult
from .inputs import adversarial
from .keys import m_bucket

__all__ = ["PROBE_ROWS", "PROBE_FULL_N_MAX", "PROBE_N_TILE", "ProbeSet", "probe", "probe_shapes"]

#: Probe: 16 rows (random + adversarial), fed to the backend in chunks of min(bucket, 16) rows.
PROBE_ROWS = 16
#: Probe columns: N itself up to this, else PROBE_N_TILE + N % PROBE_N_TILE (keeps N's residue
#: modulo every power-of-two tile width up to 256, so tail tiles are exercised) -- the float64
#: reference and bound at the full N of an LLM layer cost seconds.
PROBE_FULL_N_MAX = 512
PROBE_N_TILE = 256


def probe_shapes(case: Case) -> tuple[int, int]:
    """(rows per probe call, columns of the probe's weight) for ``case``."""
    mp = min(m_bucket(case.M), PROBE_ROWS)
    n_probe = case.N if case.N <= PROBE_FULL_N_MAX else PROBE_N_TILE + case.N % PROBE_N_TILE
    return mp, n_probe


def _check_quantized(q: Any, x: torch.Tensor, scheme: QuantScheme) -> tuple[float, str]:
    """Worst ratio of the backend's activation quantization against the spec (inf on a
    structural violation), and where: the scale within ``bounds.scale_error_bound``, the codes
    within ``bounds.conforming_quantization_error_bound`` of the spec's quantization, both judged by
    ``fp8ref.spec.compare``."""
    if not isinstance(q, Quantized):
        return math.inf, f"quantize returned {type(q).__name__}, not Quantized"
    if q.scheme != scheme:
        return math.inf, f"quantize returned scheme {q.scheme.short_str()}, asked {scheme.short_str()}"
    if tuple(q.data.shape) != tuple(x.shape):
        return math.inf, f"quantize returned data {tuple(q.data.shape)} for x {tuple(x.shape)}"
    ref = quantize(x, scheme)
    scale = compare("quantize scale vs reference", q.scale, ref.scale, bounds.scale_error_bound(ref.scale, scheme))
    if not scale.ok:
        return scale.ratio, scale.message()
    qc = Quantized(q.data.cpu(), q.scale.cpu(), q.scheme)
    # The codes' bound is the spec's (from its scale), never one computed from the scale the
    # backend returned: a scale that clips is measured against the spec's (docs/spec.md §5.1).
    codes = compare("quantize codes: dequantized vs x", dequantize(qc, torch.float64), x.cpu(),
                    bounds.conforming_quantization_error_bound(
                        x.cpu(), Quantized(ref.data.cpu(), ref.scale.cpu(), ref.scheme)))
    worst = max(scale, codes, key=lambda v: v.ratio)
    return worst.ratio, worst.message()


def _ratio(y: Any, y_ref: torch.Tensor, bound: torch.Tensor, out_dtype: torch.dtype, what: str) -> tuple[float, str]:
    v = compare(what, y, y_ref, bound, dtype=out_dtype)
    return v.ratio, v.message()


class ProbeSet:
    """The probe's inputs and the reference's side of every check, built once per case and shared
    by all the candidates (the bounds cost far more than a backend call)."""

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
        act = recipe.activation
        # Row-independent activation scales: the 16 rows quantized together equal the chunks
        # quantized apart, so the reference side is computed once on all rows.
        self.row_independent = act.granularity in (Granularity.ROW, Granularity.GROUP) or (
            act.granularity is Granularity.BLOCK and act.block[0] == 1)
        self.qa_ref = [quantize(self.x[a:b], act) for a, b in self.chunks]
        self._bounds: dict[tuple, torch.Tensor] = {}
        self._y_ref: dict[int, torch.Tensor] = {}

    def reference_side(self, i: int | None, qa: Quantized, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(y_ref float64, gemm bound) for activations ``qa``; memoised when ``qa`` is the reference's."""
        key = (i, backend.accumulation, backend.output_roundings)
        if i is not None and key in self._bounds:
            return self._y_ref[i], self._bounds[key]
        y_ref = self._y_ref.get(i) if i is not None else None
        if y_ref is None:
            y_ref = scaled_mm(qa, self.qw, self.bias, out_dtype=torch.float64)
        gb = bounds.gemm_error_bound(qa, self.qw, self.bias, out_dtype=self.case.out_dtype,
                                     accumulation=backend.accumulation, output_roundings=backend.output_roundings,
                                     y_ref=y_ref)
        if i is not None:
            self._y_ref[i], self._bounds[key] = y_ref, gb
        return y_ref, gb


def _same_output(y_lin: Any, y: Any, rows: tuple[int, int]) -> tuple[float, str]:
    """``Backend.linear`` must return what ``scaled_mm(quantize(x))`` returns, bit for bit."""
    if not isinstance(y_lin, torch.Tensor) or not isinstance(y, torch.Tensor):
        return 0.0, ""  # a non-tensor y is reported by the scaled_mm check
    v = compare_bits(f"linear() vs scaled_mm(quantize()) on rows {rows}", y_lin, y)
    return v.ratio, v.message()


def _refuses_non_finite(backend: Backend, x: torch.Tensor, prepared: Any, N: int, bias: torch.Tensor | None,
                        od: torch.dtype, act: QuantScheme) -> tuple[float, str]:
    """A backend declaring ``rejects_non_finite`` must raise ``ValueError`` for NaN in x and in the
    bias, as the spec does (``fp8ref.linear`` then skips its own scans): inf and why if it does not."""
    bad_x = x.clone()
    bad_x[0, 0] = float("nan")
    bad_bias = torch.zeros(N, dtype=x.dtype, device=x.device) if bias is None else bias.clone()
    bad_bias[0] = float("nan")
    for what, args in (("x", (bad_x, prepared, bias, od, act)), ("bias", (x, prepared, bad_bias, od, act))):
        try:
            backend.linear(*args)
        except ValueError:
            continue
        return math.inf, f"declares rejects_non_finite, but linear() with NaN in {what} did not raise ValueError"
    return 0.0, ""


def _cat(qs: list[Quantized]) -> Quantized:
    return Quantized(torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]), qs[0].scheme)


def _same(a: Quantized, b: Quantized) -> bool:
    return a.scheme == b.scheme and compare_bits("scale", a.scale, b.scale).ok and compare_bits(
        "codes", a.data, b.data).ok


def probe(backend: Backend, case: Case, *, seed: int = 0, _set: ProbeSet | None = None) -> ProbeResult:
    """Check ``backend`` against the spec's bounds at ``case``'s shape, on random plus adversarial
    inputs, and time its calls.

    Checks 1 and 2 are elementwise against a bound of ``fp8ref.spec.bounds``, whose sum is the
    end-to-end contract (``linear_error_bound`` is built from exactly these two terms):

    1. ``backend.quantize`` of the activations: scales within ``scale_error_bound`` of the
       reference's (one step of ``scale_dtype``: a faithful rounding of ``amax / qmax``), and
       ``|deq(q) - x| <= conforming_quantization_error_bound(x, quantize(x))`` (the spec's scale);
    2. ``backend.scaled_mm`` of *its own* quantized activations and the (prepared) reference-
       quantized weight, against the reference's scaled_mm of the same operands, within
       ``gemm_error_bound`` for the backend's declared accumulation and output roundings;
    3. ``backend.linear`` (the fused hook ``fp8ref.linear`` runs) returns the same bits as the
       two calls of 1 and 2;
    4. a backend that declares ``rejects_non_finite`` raises ``ValueError`` for NaN in x and in
       the bias.

    Inputs: 16 activation rows (outlier channels, an all-zero row, rounding ties, huge dynamic
    range, a constant row, a single non-zero, +-qmax, random), fed in chunks of
    ``min(bucket(M), 16)`` rows so the backend runs at the bucket's own small M; a weight with
    outlier, all-zero and tie rows; a bias if the case has one. K is the case's K; N is the
    case's N up to 512, else ``256 + N % 256``.

    Every comparison is ``fp8ref.spec.compare`` (the one the conformance contracts make).

    Returns
    -------
    ProbeResult
        ``compliant`` is True when every ratio error/bound is <= 1 and nothing raised.

    Examples
    --------
    >>> import fp8ref
    >>> from fp8ref.select import probe
    >>> case = fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8)
    >>> probe(fp8ref.get_backend("reference"), case).compliant
    True
    """
    ps = ProbeSet(case, seed) if _set is None else _set
    od, act, dev = case.out_dtype, case.recipe.activation, case.device
    worst = {"quantize": 0.0, "scaled_mm": 0.0}
    where = {k: "" for k in worst}
    elements = ps.mp * ps.n_probe

    def note(check: str, ratio_where: tuple[float, str]) -> None:
        if ratio_where[0] > worst[check] or not where[check]:
            worst[check], where[check] = ratio_where

    warm_t = math.inf
    try:
        prepared = backend.prepare_weight(_to_device(ps.qw, dev))
        bias_d = None if ps.bias is None else ps.bias.to(dev)
        qas, ys = [], []
        for a, b in ps.chunks:
            xc_d = ps.x[a:b].to(dev)
            qa = backend.quantize(xc_d, act)
            y = backend.scaled_mm(qa, prepared, bias_d, od)
            note("quantize", _check_quantized(qa, ps.x[a:b], act))
            if worst["quantize"] > 1.0:  # a wrong scale or code: the GEMM checks would only echo it
                break
            note("scaled_mm", _same_output(backend.linear(xc_d, prepared, bias_d, od, act), y, (a, b)))
            qas.append(Quantized(qa.data.cpu(), qa.scale.cpu(), qa.scheme))
            ys.append(y.detach().cpu() if isinstance(y, torch.Tensor) else y)
        # One more call, warm (a first call may compile or autotune): the basis of the estimate
        # that lets the timing skip backends that cannot win.
        xc_d = ps.x[ps.chunks[0][0]:ps.chunks[0][1]].to(dev)
        timing.sync(dev)
        t0 = timing.clock()
        backend.linear(xc_d, prepared, bias_d, od, act)
        timing.sync(dev)
        warm_t = timing.clock() - t0
        if backend.rejects_non_finite:
            note("quantize", _refuses_non_finite(backend, xc_d, prepared, ps.n_probe, bias_d, od, act))
        if worst["quantize"] <= 1.0:
            bad = next((y for y in ys if not isinstance(y, torch.Tensor) or y.dim() != 2), None)
            if bad is not None:
                note("scaled_mm", (math.inf, f"scaled_mm returned {type(bad).__name__} "
                                             f"{tuple(getattr(bad, 'shape', ()))}"))
            elif ps.row_independent:
                qa_all = _cat(qas)
                same = all(_same(q, r) for q, r in zip(qas, ps.qa_ref, strict=True))
                y_ref, gb = ps.reference_side(-1 if same else None, qa_all if not same else _cat(ps.qa_ref),
                                              backend)
                note("scaled_mm", _ratio(torch.cat(ys), y_ref, gb, od, "scaled_mm"))
            else:
                for i, (qa, y) in enumerate(zip(qas, ys, strict=True)):
                    same = _same(qa, ps.qa_ref[i])
                    y_ref, gb = ps.reference_side(i if same else None, qa, backend)
                    note("scaled_mm", _ratio(y, y_ref, gb, od, f"scaled_mm (rows {ps.chunks[i]})"))
    except Exception as exc:  # a backend that raises on valid input at its own declared case fails
        return ProbeResult(False, math.inf, f"raised {type(exc).__name__}: {exc}", math.inf, elements,
                           {k: math.inf for k in worst})
    top = max(worst, key=worst.get)
    return ProbeResult(worst[top] <= 1.0, worst[top], where[top], warm_t, elements, worst)


def _to_device(q: Quantized, device: str) -> Quantized:
    if q.data.device == torch.device(device):
        return q
    return Quantized(q.data.to(device), q.scale.to(device), q.scheme, q.n_saturated)
