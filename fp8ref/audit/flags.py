"""When a layer or a model is flagged: the audit's thresholds (``Thresholds``) applied to its figures."""

from __future__ import annotations

import math

from .report import LayerStats, ModelMetrics, Thresholds

__all__ = ["layer_flags", "model_flags"]


def layer_flags(s: LayerStats, th: Thresholds, nonfinite: int) -> list[str]:
    flags = []
    if not (s.own.sqnr_db >= th.min_sqnr_db):
        flags.append(f"own SQNR {s.own.sqnr_db:.1f} dB < {th.min_sqnr_db:g}")
    if s.bound_ratio_max > th.max_bound_ratio or math.isnan(s.bound_ratio_max) and s.bound_samples:
        flags.append(f"error/bound {s.bound_ratio_max:.3g} > {th.max_bound_ratio:g}: outside the spec's bound")
    if s.weight_flushed > th.max_flushed:
        flags.append(f"{s.weight_flushed:.0%} of non-zero weights flushed to 0")
    if s.act_flushed > th.max_flushed:
        flags.append(f"{s.act_flushed:.0%} of non-zero activations flushed to 0")
    if nonfinite:
        flags.append(f"non-finite input in the FP8 model ({nonfinite} call(s))")
    return flags


def model_flags(m: ModelMetrics, th: Thresholds, layers: list[LayerStats]) -> list[str]:
    flags = []
    if m.kind == "causal_lm":
        if not (m.top1_agreement >= th.min_top1):
            flags.append(f"top-1 agreement {m.top1_agreement:.3f} < {th.min_top1:g}")
        if not (m.kl_mean <= th.max_kl):
            flags.append(f"mean KL {m.kl_mean:.3g} > {th.max_kl:g}")
        if m.n_tokens and m.ppl_fp == m.ppl_fp and not (m.ppl_fp8 <= th.max_ppl_ratio * m.ppl_fp):
            flags.append(f"perplexity {m.ppl_fp8:.4g} > {th.max_ppl_ratio:g} x float {m.ppl_fp:.4g}")
    else:
        if not (m.embedding_cosine_mean >= th.min_embedding_cosine):
            flags.append(f"embedding cosine {m.embedding_cosine_mean:.4f} < {th.min_embedding_cosine:g}")
    if layers and all(lay.flags for lay in layers):
        flags.append(f"every one of the {len(layers)} layers is flagged")
    return flags
