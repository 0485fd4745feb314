"""Precision-drift audits: FP8 against float, per layer and per model, and drift between audits.

See docs/audit.md. The real models and texts (``material``) need the ``audit`` extra; the rest
needs only torch.
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
