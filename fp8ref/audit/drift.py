"""Drift: compare two audits (backend A vs B, or today vs a stored baseline) against thresholds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .report import AuditReport, BackendAudit, Thresholds

__all__ = ["DriftItem", "DriftReport", "compare_audits", "compare_reports"]


@dataclass(frozen=True)
class DriftItem:
    """One metric that moved past its threshold (``layer`` is ``"<model>"`` for model metrics)."""

    layer: str
    metric: str
    before: float
    after: float
    change: float
    threshold: float

    def __str__(self) -> str:
        return (f"{self.layer}: {self.metric} {self.before:.6g} -> {self.after:.6g} "
                f"(change {self.change:+.4g}, threshold {self.threshold:g})")


@dataclass
class DriftReport:
    """The result of a comparison: what was compared, every drifted metric, layers missing."""

    before: str
    after: str
    items: list[DriftItem] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def drifted(self) -> bool:
        return bool(self.items or self.missing)

    @property
    def layers(self) -> list[str]:
        """Names of the layers that drifted, in order of first appearance."""
        return list(dict.fromkeys(i.layer for i in self.items if i.layer != "<model>"))

    def to_markdown(self) -> str:
        out = [f"## Drift: `{self.before}` -> `{self.after}`", ""]
        if not self.drifted:
            return "\n".join(out + ["No drift beyond the thresholds.", ""])
        out += [f"{len(self.items)} metric(s) drifted in {len(self.layers)} layer(s)"
                f"{' and the model metrics' if any(i.layer == '<model>' for i in self.items) else ''}.", "",
                "| layer | metric | before | after | change | threshold |", "|---|---|---:|---:|---:|---:|"]
        out += [f"| {i.layer} | {i.metric} | {i.before:.6g} | {i.after:.6g} | {i.change:+.4g} | {i.threshold:g} |"
                for i in self.items]
        if self.missing:
            out += ["", "Layers in one audit only: " + ", ".join(self.missing)]
        return "\n".join(out) + "\n"


def _worse(items: list[DriftItem], layer: str, metric: str, a: float, b: float, thr: float,
           higher_is_worse: bool, relative: bool = False) -> None:
    """Record a drift item when ``b`` is worse than ``a`` by more than ``thr`` (NaN after a
    finite value is always drift: the metric broke)."""
    if math.isnan(b) and not math.isnan(a):
        items.append(DriftItem(layer, metric, a, b, math.nan, thr))
        return
    if math.isnan(a) or math.isnan(b):
        return
    if math.isinf(a) and math.isinf(b) and a == b:
        return
    change = b - a
    if relative:
        change = change / abs(a) if a else (math.inf if change else 0.0)
    if (change > thr) if higher_is_worse else (change < -thr):
        items.append(DriftItem(layer, metric, a, b, change, thr))


def _paired(a: list, b: list) -> tuple[float, float] | None:
    """(mean, standard error) of the per-token differences b - a, when both scored the same tokens."""
    if len(a) != len(b) or len(a) < 2:
        return None
    d = torch.tensor(b, dtype=torch.float64) - torch.tensor(a, dtype=torch.float64)
    return float(d.mean()), float(d.std()) / math.sqrt(d.numel())


def _flips(a: list, b: list) -> tuple[int, int, int] | None:
    """(tokens agreeing before and not after, the reverse, tokens) for the same tokens' top-1 flags."""
    if len(a) != len(b) or len(a) < 2:
        return None
    lost = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    gained = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    return lost, gained, len(a)


def _sign_test_p(lost: int, gained: int) -> float:
    """One-sided exact sign (McNemar) test: P(X >= lost) for X ~ Binomial(lost + gained, 1/2), the
    chance that flips as lopsided as these come from two equally good backends.

    Top-1 agreement is a 0/1 flag per token, so only the flipped tokens carry information; the
    normal approximation (mean over standard error of the per-token differences) is poor when few
    tokens flip: four flips out of 128, all one way, pass it at 2.02 standard errors, yet even
    odds give that pattern once in 16 runs (the SmolLM2 reference-vs-auto audit test failed that way
    on 2026-12-01)."""
    n = lost + gained
    return sum(math.comb(n, k) for k in range(lost, n + 1)) / 2**n if n else 1.0


def _one_sided_alpha(sigmas: float) -> float:
    """The one-sided normal tail beyond ``sigmas`` (2 -> 0.0228): the sign test's significance level."""
    return 0.5 * math.erfc(sigmas / math.sqrt(2.0))


def _model_drift(items: list[DriftItem], ma, mb, th: Thresholds) -> None:
    """Perplexity, KL and top-1 drift; paired over tokens when both audits kept per-token values of
    the same length (NLL and KL: a noise floor of ``drift_sigmas`` standard errors of the
    differences; top-1: the exact sign test on the flipped tokens at the same one-sided level)."""
    p = _paired(ma.token_nll, mb.token_nll)
    if p is None:
        _worse(items, "<model>", "perplexity", ma.ppl_fp8, mb.ppl_fp8, th.drift_ppl_rel, True, relative=True)
    else:
        rel = math.expm1(p[0])  # mean NLL difference = log(ppl_b / ppl_a)
        if rel > th.drift_ppl_rel and p[0] > th.drift_sigmas * p[1]:
            items.append(DriftItem("<model>", "perplexity", ma.ppl_fp8, mb.ppl_fp8, rel, th.drift_ppl_rel))
    p = _paired(ma.token_kl, mb.token_kl)
    if p is None:
        _worse(items, "<model>", "mean KL", ma.kl_mean, mb.kl_mean, th.drift_kl, True)
    elif p[0] > th.drift_kl and p[0] > th.drift_sigmas * p[1]:
        items.append(DriftItem("<model>", "mean KL", ma.kl_mean, mb.kl_mean, p[0], th.drift_kl))
    flips = _flips(ma.token_top1, mb.token_top1)
    if flips is None:
        _worse(items, "<model>", "top-1 agreement", ma.top1_agreement, mb.top1_agreement, th.drift_top1, False)
    else:
        lost, gained, n = flips
        change = (gained - lost) / n
        if -change > th.drift_top1 and _sign_test_p(lost, gained) < _one_sided_alpha(th.drift_sigmas):
            items.append(DriftItem("<model>", "top-1 agreement", ma.top1_agreement, mb.top1_agreement, change,
                                   th.drift_top1))


def compare_audits(before: BackendAudit, after: BackendAudit, thresholds: Thresholds | None = None,
                   *, before_name: str = "", after_name: str = "") -> DriftReport:
    """Compare two backend audits layer by layer and on the model metrics.

    A layer drifts when its own SQNR drops by more than ``drift_sqnr_db`` (in-model SQNR:
    ``drift_total_sqnr_db``), its worst
    error/bound ratio grows by more than ``drift_bound_ratio`` or passes 1 (the spec's bound),
    or its flushed-to-zero fraction of weights or activations grows by more than
    ``drift_flushed``. The model drifts when perplexity grows by more than ``drift_ppl_rel``
    (relative), mean KL by more than ``drift_kl``, top-1 agreement drops by more than
    ``drift_top1``, or the embedding cosine / NN agreement drop past theirs. When both audits
    kept per-token values of the same tokens, perplexity, KL and top-1 are compared pairwise and
    must also move by more than ``drift_sigmas`` standard errors of the per-token differences (for
    top-1 agreement, a 0/1 flag per token: an exact sign test on the flipped tokens at the same
    one-sided level, 2.3 % for 2 sigmas).

    Examples
    --------
    >>> from fp8ref.audit.report import BackendAudit, ModelMetrics
    >>> a = BackendAudit("x", ["x"], "", [], ModelMetrics(ppl_fp8=10.0, kl_mean=0.01, top1_agreement=0.95))
    >>> b = BackendAudit("y", ["y"], "", [], ModelMetrics(ppl_fp8=12.0, kl_mean=0.01, top1_agreement=0.95))
    >>> [str(i) for i in compare_audits(a, b).items]
    ['<model>: perplexity 10 -> 12 (change +0.2, threshold 0.01)']
    """
    th = thresholds or Thresholds()
    items: list[DriftItem] = []
    la = {x.name: x for x in before.layers}
    lb = {x.name: x for x in after.layers}
    missing = sorted(set(la) ^ set(lb))
    for name, b in lb.items():
        a = la.get(name)
        if a is None:
            continue
        _worse(items, name, "own SQNR dB", a.own.sqnr_db, b.own.sqnr_db, th.drift_sqnr_db, False)
        _worse(items, name, "in-model SQNR dB", a.total.sqnr_db, b.total.sqnr_db, th.drift_total_sqnr_db, False)
        _worse(items, name, "error/bound", a.bound_ratio_max, b.bound_ratio_max, th.drift_bound_ratio, True)
        if (b.bound_ratio_max > th.max_bound_ratio and not a.bound_ratio_max > th.max_bound_ratio
                and not any(i.layer == name and i.metric == "error/bound" for i in items)):
            items.append(DriftItem(name, "error/bound", a.bound_ratio_max, b.bound_ratio_max,
                                   b.bound_ratio_max - a.bound_ratio_max, th.max_bound_ratio))
        _worse(items, name, "weights flushed", a.weight_flushed, b.weight_flushed, th.drift_flushed, True)
        _worse(items, name, "activations flushed", a.act_flushed, b.act_flushed, th.drift_flushed, True)
    ma, mb = before.model, after.model
    if mb.kind == "causal_lm":
        _model_drift(items, ma, mb, th)
    else:
        _worse(items, "<model>", "embedding cosine", ma.embedding_cosine_mean, mb.embedding_cosine_mean,
               th.drift_cosine, False)
        _worse(items, "<model>", "NN agreement", ma.nn_agreement, mb.nn_agreement, th.drift_nn, False)
    return DriftReport(before_name or before.backend, after_name or after.backend, items, missing)


def compare_reports(before: AuditReport, after: AuditReport, *, backend: str | None = None,
                    thresholds: Thresholds | None = None) -> list[DriftReport]:
    """Compare a report with a baseline report, backend by backend.

    Parameters
    ----------
    before : AuditReport
        The baseline (e.g. ``AuditReport.load("baseline.json")``).
    after : AuditReport
        Today's audit.
    backend : str, optional
        Compare only this backend; otherwise every backend present in both reports.
    thresholds : Thresholds, optional
        Default: ``after.thresholds``.

    Returns
    -------
    list of DriftReport
        One per backend compared. A backend in the baseline but absent now is reported as a
        drift with every baseline layer missing.

    Examples
    --------
    >>> from fp8ref.audit.report import AuditReport, BackendAudit, ModelMetrics
    >>> def report(top1):
    ...     m = ModelMetrics(ppl_fp8=10.0, kl_mean=0.01, top1_agreement=top1)
    ...     return AuditReport("m", "w8a8_fp8", "t", [BackendAudit("auto", ["cpu-fp32"], "", [], m)])
    >>> [d.drifted for d in compare_reports(report(0.95), report(0.95))]
    [False]
    >>> print(compare_reports(report(0.95), report(0.80))[0].items[0])
    <model>: top-1 agreement 0.95 -> 0.8 (change -0.15, threshold 0.02)
    """
    th = thresholds or after.thresholds
    if before.recipe != after.recipe:
        raise ValueError(f"the reports use different recipes ({before.recipe} vs {after.recipe}): not comparable")
    names = [backend] if backend else [a.backend for a in before.audits]
    out = []
    for n in names:
        try:
            a = before.audit(n)
        except KeyError:
            if backend:
                raise
            continue
        try:
            b = after.audit(n)
        except KeyError:
            out.append(DriftReport(f"baseline:{n}", f"now:{n} (absent)", missing=[x.name for x in a.layers]))
            continue
        out.append(compare_audits(a, b, th, before_name=f"baseline:{n}", after_name=f"now:{n}"))
    return out
