"""Precision-drift audits: FP8 against float, per layer and per model, and drift between audits.

``core`` runs a model in float and in FP8 side by side (``audit_model``), with ``runner`` (one
linear the FP8 way), ``stats`` (per-layer error sums and bound ratios), ``outputs`` (batches in,
logits or embeddings and model metrics out) and ``flags``; ``report`` holds the result types,
``drift`` compares two audits, ``weights`` audits a safetensors checkpoint, ``material`` loads the
real models and texts (the ``audit`` extra), ``plots`` and ``results`` make docs/results.md.
Imports flow from the spec, the registry, the selector and ``fp8ref.api`` into this package;
nothing but the CLI imports it. See docs/audit.md.
"""

from .core import RATIO_BIN_EDGES, audit_model, linear_layers
from .drift import DriftItem, DriftReport, compare_audits, compare_reports
from .report import AuditReport, BackendAudit, ErrorStats, LayerStats, ModelMetrics, Thresholds
from .weights import TensorStats, WeightAudit, audit_safetensors

__all__ = [
    "AuditReport",
    "BackendAudit",
    "DriftItem",
    "DriftReport",
    "ErrorStats",
    "LayerStats",
    "ModelMetrics",
    "RATIO_BIN_EDGES",
    "TensorStats",
    "Thresholds",
    "WeightAudit",
    "audit_model",
    "audit_safetensors",
    "compare_audits",
    "compare_reports",
    "linear_layers",
]
