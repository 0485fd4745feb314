"""``fp8ref.linear``, ``fp8ref.explain`` and the reference linear, and the plans their calls run.

Every entry point that takes a caller's tensors (``linear``, ``explain``, ``reference_linear``, and
through their plans ``Fp8Linear`` and ``torch.ops.fp8ref.linear``) checks them with
``fp8ref.spec.checks`` before any selection, probe or kernel runs: types, layouts and devices,
dtypes, shapes, the output dtype, then NaN/Inf. Each error names the offending argument. The checks
of a weight run once per weight (they are cached with its quantized form); a warm call runs its
``Plan`` (``plans``) after the few checks the case still needs.

``calls`` holds the user-facing functions and ``fp8ref.linear``'s weight cache; ``plans`` the
``Plan`` (one weight under one case, resolved), the per-weight ``WeightEntry`` and the
``LayerPlans`` a layer holds; ``moe`` the mixture-of-experts entry point. Imports flow from the
spec, the registry, the selector and ``fp8ref.weightcheck`` into ``plans``, then ``calls``;
``fp8ref.ops`` and ``fp8ref.nn`` import this package.
"""

from ..spec.checks import X_DTYPES, check_linear_args
from .calls import (
    _WEIGHTS,  # noqa: F401  (the weight cache: tests look into it)
    ENV_WEIGHT_CHECK,
    SAMPLE_ROWS,
    WEIGHT_CHECKS,
    DispatchKey,
    MemorySample,
    clear_weight_cache,
    explain,
    flatten_activations,
    linear,
    quantize_weight,
    reference_linear,
    tensor_version,
)
from .moe import moe
from .plans import STATS, LayerPlans, Plan

__all__ = ["reference_linear", "quantize_weight", "flatten_activations", "linear", "explain", "clear_weight_cache",
           "tensor_version", "check_linear_args", "X_DTYPES", "WEIGHT_CHECKS", "ENV_WEIGHT_CHECK", "DispatchKey",
           "MemorySample", "SAMPLE_ROWS", "Plan", "LayerPlans", "STATS", "moe"]
