"""The audit's results: per-layer statistics, model metrics, flags; JSON and Markdown forms.

Floats that are not finite (an SQNR of +inf when a layer makes no error, a cosine of NaN
when an output is all zero) are written to JSON as the strings ``"inf"``, ``"-inf"`` and
``"nan"`` so the file stays standard JSON, and read back as floats.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["ErrorStats", "LayerStats", "ModelMetrics", "BackendAudit", "AuditReport", "Thresholds",
           "SCHEMA_VERSION"]

#: Bumped when a field changes meaning; ``AuditReport.load`` refuses other versions.
SCHEMA_VERSION = 1


def _enc(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _enc(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_enc(x) for x in v]
    return v


def _dec_float(v: Any) -> Any:
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return v


def _from_dict(cls, d: dict):
    """Build dataclass ``cls`` from ``d``, decoding non-finite floats; unknown keys are an error."""
    names = {f.name for f in fields(cls)}
    extra = set(d) - names
    if extra:
        raise ValueError(f"{cls.__name__}: unknown field(s) {sorted(extra)} in the report")
    return cls(**{k: _dec_float(v) for k, v in d.items()})


@dataclass(frozen=True)
class Thresholds:
    """When a layer or a model is flagged, and when a difference between two audits is drift.

    The per-report health flags are coarse: they catch broken quantization (sglang#4434's
    all-zero weights gives SQNR 0 dB, cosine 0, top-1 agreement near chance), not the ~30 dB
    of a healthy E4M3 layer. ``max_bound_ratio`` is not a choice: an error above the spec's
    derived end-to-end bound (ratio > 1) means the backend does not compute what the spec says.

    Attributes
    ----------
    min_sqnr_db : float
        Flag a layer whose own output SQNR is below this (healthy E4M3 W8A8 layers: ~25-35 dB).
    max_bound_ratio : float
        Flag a layer whose worst |error| / bound exceeds this (1: the derived bound).
    max_flushed : float
        Flag a layer where more than this fraction of non-zero weights or activations became 0.
    min_top1 : float
        Flag a causal LM whose top-1 agreement with the float model is below this.
    max_kl : float
        Flag a causal LM whose mean KL(fp || fp8) per token exceeds this (nats).
    max_ppl_ratio : float
        Flag a causal LM whose FP8 perplexity exceeds the float one by more than this factor.
    min_embedding_cosine : float
        Flag an encoder whose mean embedding cosine to the float model is below this.
    drift_sqnr_db : float
        Drift: a layer's own SQNR drops by more than this many dB.
    drift_total_sqnr_db : float
        Drift: a layer's in-model SQNR drops by more than this many dB. Looser, because the
        error a layer receives is chaotic: two compliant backends (``reference`` and ``cpu-fp32``)
        were measured 4.2 dB apart on one SmolLM2 layer over 64 tokens.
    drift_bound_ratio : float
        Drift: a layer's worst error/bound ratio grows by more than this (absolute).
    drift_flushed : float
        Drift: a layer's flushed-to-zero fraction grows by more than this (absolute).
    drift_ppl_rel : float
        Drift: perplexity grows by more than this fraction.
    drift_kl : float
        Drift: mean KL grows by more than this (nats).
    drift_top1 : float
        Drift: top-1 agreement drops by more than this (absolute fraction).
    drift_sigmas : float
        When both audits scored the same tokens, a model-metric change must also exceed this
        many standard errors of the paired per-token differences (a few flipped tokens out of
        64 are noise, not drift); top-1 agreement uses the exact sign test on the flipped
        tokens at the same one-sided level (2 -> 2.3 %).
    drift_cosine : float
        Drift: mean embedding cosine drops by more than this.
    drift_nn : float
        Drift: nearest-neighbour agreement drops by more than this (absolute fraction).
    """

    min_sqnr_db: float = 10.0
    max_bound_ratio: float = 1.0
    max_flushed: float = 0.5
    min_top1: float = 0.5
    max_kl: float = 1.0
    max_ppl_ratio: float = 1.5
    min_embedding_cosine: float = 0.9
    drift_sqnr_db: float = 1.0
    drift_total_sqnr_db: float = 6.0
    drift_bound_ratio: float = 0.25
    drift_flushed: float = 0.01
    drift_ppl_rel: float = 0.01
    drift_kl: float = 0.01
    drift_top1: float = 0.02
    drift_cosine: float = 0.002
    drift_nn: float = 0.05
    drift_sigmas: float = 2.0


@dataclass
class ErrorStats:
    """Error of an FP8 output ``y`` against a float reference ``r`` (summed over all calls).

    rel_l2 = ||y - r|| / ||r||; sqnr_db = 10 log10(||r||^2 / ||y - r||^2) (inf when y == r);
    cosine = <y, r> / (||y|| ||r||) (nan when either is all zero); max_abs = max |y - r|.
    """

    rel_l2: float = float("nan")
    max_abs: float = float("nan")
    sqnr_db: float = float("nan")
    cosine: float = float("nan")


@dataclass
class LayerStats:
    """One ``nn.Linear`` under one backend.

    ``own`` is the layer's own error: fed the float model's exact input, FP8 output against the
    float output. ``total`` is what the FP8 model computes at this layer (its input already
    carries the error of every earlier layer) against the float model's output; ``input_rel_l2``
    is that incoming error, and ``propagated_rel_l2`` the part of ``total`` it causes through
    the float layer (||W x_fp8 - W x_fp|| / ||W x_fp||).
    """

    name: str
    depth: int
    out_features: int
    in_features: int
    backend: str
    own: ErrorStats = field(default_factory=ErrorStats)
    total: ErrorStats = field(default_factory=ErrorStats)
    input_rel_l2: float = float("nan")
    propagated_rel_l2: float = float("nan")
    bound_ratio_max: float = float("nan")
    bound_samples: int = 0
    bound_ratio_hist: list[float] = field(default_factory=list)
    weight_saturated: float = 0.0
    weight_flushed: float = 0.0
    act_saturated: float = 0.0
    act_flushed: float = 0.0
    weight_scale_min: float = float("nan")
    weight_scale_max: float = float("nan")
    act_scale_min: float = float("nan")
    act_scale_max: float = float("nan")
    flags: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> LayerStats:
        d = dict(d)
        d["own"] = _from_dict(ErrorStats, d.get("own", {}))
        d["total"] = _from_dict(ErrorStats, d.get("total", {}))
        d["bound_ratio_hist"] = [_dec_float(v) for v in d.get("bound_ratio_hist", [])]
        return _from_dict(cls, d)


@dataclass
class ModelMetrics:
    """Model-level comparison of the FP8 model with the float one.

    Causal LMs fill ``ppl_fp``, ``ppl_fp8`` (exp of the mean next-token NLL), ``kl_mean`` and
    ``kl_max`` (KL(fp || fp8) per token, nats) and ``top1_agreement`` (fraction of positions
    whose argmax agrees). Encoders fill ``embedding_cosine_mean``/``_min`` (mean-pooled
    sentence embeddings) and ``nn_agreement`` (fraction of sentences whose nearest neighbour,
    by cosine, is the same under both models). ``token_nll``, ``token_kl`` and ``token_top1``
    keep the per-token FP8 NLL, KL and agreement (0/1) so that two audits of the same tokens
    can be compared pairwise.
    """

    kind: str = "causal_lm"
    n_tokens: int = 0
    n_sequences: int = 0
    ppl_fp: float = float("nan")
    ppl_fp8: float = float("nan")
    kl_mean: float = float("nan")
    kl_max: float = float("nan")
    top1_agreement: float = float("nan")
    token_nll: list[float] = field(default_factory=list)
    token_kl: list[float] = field(default_factory=list)
    token_top1: list[int] = field(default_factory=list)
    embedding_cosine_mean: float = float("nan")
    embedding_cosine_min: float = float("nan")
    nn_agreement: float = float("nan")


@dataclass
class BackendAudit:
    """Everything measured for one backend (the name asked for, and what it resolved to)."""

    backend: str
    resolved: list[str]
    note: str
    layers: list[LayerStats]
    model: ModelMetrics
    flags: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def layer(self, name: str) -> LayerStats:
        for lay in self.layers:
            if lay.name == name:
                return lay
        raise KeyError(f"no layer {name!r} in the audit of backend {self.backend!r}")

    @property
    def flagged_layers(self) -> list[LayerStats]:
        return [lay for lay in self.layers if lay.flags]

    @classmethod
    def from_dict(cls, d: dict) -> BackendAudit:
        d = dict(d)
        d["layers"] = [LayerStats.from_dict(x) for x in d.get("layers", [])]
        d["model"] = _from_dict(ModelMetrics, d.get("model", {}))
        return _from_dict(cls, d)


@dataclass
class AuditReport:
    """The result of ``fp8ref.audit.audit_model``: one ``BackendAudit`` per backend, plus context."""

    model: str
    recipe: str
    text: str
    audits: list[BackendAudit]
    meta: dict[str, Any] = field(default_factory=dict)
    thresholds: Thresholds = field(default_factory=Thresholds)
    schema: int = SCHEMA_VERSION

    def audit(self, backend: str) -> BackendAudit:
        """The audit of ``backend`` (the name it was asked for, e.g. ``"auto"``)."""
        for a in self.audits:
            if a.backend == backend:
                return a
        raise KeyError(f"backend {backend!r} not in this report; it has {[a.backend for a in self.audits]}")

    @property
    def flagged(self) -> bool:
        return any(a.flags or a.flagged_layers for a in self.audits)

    # -- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return _enc(asdict(self))

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON report to ``path`` (its folder must exist)."""
        p = Path(path)
        p.write_text(self.to_json())
        return p

    @classmethod
    def from_dict(cls, d: dict) -> AuditReport:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA_VERSION:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"not an fp8ref audit report of schema {SCHEMA_VERSION} (schema: {got!r})")
        d = dict(d)
        d["audits"] = [BackendAudit.from_dict(a) for a in d["audits"]]
        d["thresholds"] = _from_dict(Thresholds, d.get("thresholds", {}))
        return _from_dict(cls, d)

    @classmethod
    def from_json(cls, text: str) -> AuditReport:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> AuditReport:
        """Read a report written by ``save`` (e.g. a stored baseline)."""
        p = Path(path)
        try:
            return cls.from_json(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not valid JSON ({exc})") from None

    # -- Markdown --------------------------------------------------------------------------------
    def to_markdown(self, max_layers: int | None = None) -> str:
        """A human-readable summary: model metrics per backend, flags, then the per-layer table."""
        out = [f"# FP8 audit: {self.model}", "",
               f"recipe `{self.recipe}`, text `{self.text}`"]
        for k, v in self.meta.items():
            out.append(f"- {k}: {v}")
        out += ["", "## Model metrics", ""]
        kind = self.audits[0].model.kind if self.audits else "causal_lm"
        if kind == "causal_lm":
            out += ["| backend | resolved | tokens | ppl fp | ppl fp8 | KL mean | KL max | top-1 agree | flags |",
                    "|---|---|---:|---:|---:|---:|---:|---:|---|"]
            for a in self.audits:
                m = a.model
                out.append(f"| {a.backend} | {', '.join(a.resolved)} | {m.n_tokens} | {m.ppl_fp:.4f} | "
                           f"{m.ppl_fp8:.4f} | {m.kl_mean:.4g} | {m.kl_max:.4g} | {m.top1_agreement:.4f} | "
                           f"{'; '.join(a.flags) or '-'} |")
        else:
            out += ["| backend | resolved | sentences | emb. cosine mean | min | NN agreement | flags |",
                    "|---|---|---:|---:|---:|---:|---|"]
            for a in self.audits:
                m = a.model
                out.append(f"| {a.backend} | {', '.join(a.resolved)} | {m.n_sequences} | "
                           f"{m.embedding_cosine_mean:.5f} | {m.embedding_cosine_min:.5f} | {m.nn_agreement:.4f} | "
                           f"{'; '.join(a.flags) or '-'} |")
        for a in self.audits:
            if a.note:
                out.append(f"\nNote ({a.backend}): {a.note}")
        for a in self.audits:
            layers = a.layers if max_layers is None else a.layers[:max_layers]
            worst = max((lay.bound_ratio_max for lay in a.layers if math.isfinite(lay.bound_ratio_max)),
                        default=float("nan"))
            out += ["", f"## Layers, backend `{a.backend}` ({len(a.flagged_layers)} of {len(a.layers)} flagged, "
                        f"worst error/bound {worst:.3g}, {a.seconds:.1f} s)", "",
                    "| # | layer | N x K | own SQNR dB | own cos | in-model SQNR dB | input rel err | "
                    "err/bound | w sat | w flushed | a flushed | w scale | a scale | flags |",
                    "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
            for lay in layers:
                out.append(
                    f"| {lay.depth} | {lay.name} | {lay.out_features}x{lay.in_features} | {lay.own.sqnr_db:.2f} | "
                    f"{lay.own.cosine:.5f} | {lay.total.sqnr_db:.2f} | {lay.input_rel_l2:.3g} | "
                    f"{lay.bound_ratio_max:.3g} | {lay.weight_saturated:.2g} | {lay.weight_flushed:.2g} | "
                    f"{lay.act_flushed:.2g} | {lay.weight_scale_min:.2g}..{lay.weight_scale_max:.2g} | "
                    f"{lay.act_scale_min:.2g}..{lay.act_scale_max:.2g} | {'; '.join(lay.flags) or '-'} |")
            if max_layers is not None and len(a.layers) > max_layers:
                out.append(f"| ... | {len(a.layers) - max_layers} more layers in the JSON report |"
                           + " |" * 12)
        return "\n".join(out) + "\n"
