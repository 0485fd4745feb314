"""fp8ref: a reference for FP8 W8A8 inference, and a referee for the kernels that compute it.

Where things live, from the bottom up. At import time a module imports only from the entries
above its own (a function may read this face, ``fp8ref``, lazily), the imports form no cycle even
counting those inside functions, and the spec imports nothing else from fp8ref;
tests/test_layout.py checks all three.

- ``fp8ref.spec``: the spec (formats, schemes, the reference quantizer, the exact scaled GEMM,
  the derived error bounds); docs/spec.md is the same contract in prose. Beside it, the
  helpers ``_machine`` (CPU detection), ``_io`` (atomic writes), ``_progress`` (progress bars),
  ``_version`` (the package's version, which modules below this face read instead of the face),
  ``_env`` (every ``FP8REF_*`` environment variable, read and checked by one rule) and
  ``_safetensors_reader`` (safetensors files read without a memory map, parsed by safetensors).
- ``fp8ref.registry``: the backend API (``Backend``, ``Case``) and the registry of backends.
- ``fp8ref.check``: the checking core -- the conformance contracts' problems and checks (a
  backend and a problem in, the worst error/bound ratio or a located violation out), which the
  conformance driver and the selector's compliance probe both run.
- ``fp8ref.kernels``: the backends, one module each (C++ sources in ``kernels/csrc``, built by
  ``python -m fp8ref.kernels.build``).
- ``fp8ref.select``: the selector behind ``backend="auto"`` (compliance probe, timing, caches).
- ``fp8ref.weightcheck``: how a cached weight's change is noticed (``weight_check``).
- ``fp8ref.api``, ``fp8ref.ops``, ``fp8ref.nn``, ``fp8ref.surgery``, ``fp8ref.checkpoint``:
  ``fp8ref.linear``, the same as the custom operator ``torch.ops.fp8ref.linear`` (for
  ``torch.compile`` and ``torch.export``), ``Fp8Linear``, ``quantize_model``, FP8 checkpoints;
  then this face, which re-exports the public API.
- ``fp8ref.conformance``: the referee (the contract table, Hypothesis search, sweeps, reports;
  the checks themselves are ``fp8ref.check``'s).
- ``fp8ref.peers``: adapters that put real third-party FP8 code (SGLang, vLLM, onnxruntime,
  torchao, compressed-tensors, jax, quanto, Model Optimizer) behind the backend API, and the
  certification run (``fp8ref certify``) that judges them.
- ``fp8ref.audit``: precision-drift audits of real models.
- ``fp8ref.bench``: benchmarks as ratios.
- ``fp8ref.cli``: the ``fp8ref`` command, one module per subcommand (``python -m fp8ref`` runs it
  through ``__main__``).
- ``fp8ref.gpu_check``: the prepared GPU evidence run; ``fp8ref.pytest_plugin``: the
  ``fp8ref_certify`` fixture.
"""

from ._version import __version__ as __version__  # re-exported: the package's version
from .api import explain, linear, moe, reference_linear
from .checkpoint import CheckpointError, load_fp8_dynamic, save_fp8_dynamic
from .nn import Fp8Linear
from .registry import (
    PROPAGATE,
    RAISE,
    SPEC_NON_FINITE,
    Backend,
    BackendInfo,
    Case,
    MoeBackend,
    NonFinite,
    ScaleLayout,
    backends,
    get_backend,
    get_moe_backend,
    moe_backends,
    register_backend,
    register_moe_backend,
    unregister_backend,
)
from .select import BackendUnavailableError, Decision, NoCompliantBackendError, choose_backend
from .select import clear_cache as clear_selection_cache
from .select import select as select_backend
from .spec.bounds import (
    Accumulation,
    PrecisionClass,
    gamma,
    gemm_error_bound,
    linear_error_bound,
    precision_class,
    quantization_error_bound,
    reference_gemm_error_bound,
)
from .spec.formats import E4M3FN, E4M3FNUZ, E5M2, FORMATS, Fp8Format, get_format
from .spec.gemm import scaled_mm, scaled_mm_exact
from .spec.moe import MoeScheme, MoeWeights, Routing, moe_reference, quantize_experts
from .spec.moe_bounds import MoeAccuracy, moe_error_bound
from .spec.quant import Quantized, dequantize, quantize
from .spec.schemes import (
    DEFAULT_AMAX_FLOOR,
    FP8_BLOCK,
    FP8_BLOCK_UE8M0,
    FP8_DYNAMIC,
    FP8_PER_TENSOR,
    MXFP8,
    MXFP8_E5M2,
    RECIPES,
    W8A8_FP8,
    W8A8_FP8_ROCM,
    Granularity,
    QuantScheme,
    Recipe,
    get_recipe,
)
from .surgery import QuantizeSummary, quantize_model

#: Modules that moved when the tree was split by layer (fp8ref 0.1 layout): importing an old
#: name still works, returns the new module and warns once (DeprecationWarning); it goes in 0.3.
#: ``fp8ref.linear`` was a module shadowed by the function of the same name: use ``fp8ref.api``.
#: The old ``fp8ref.cli_*`` modules were the command's internals; the command line is unchanged.
MOVED_MODULES = {
    "fp8ref.formats": "fp8ref.spec.formats",
    "fp8ref.schemes": "fp8ref.spec.schemes",
    "fp8ref.quant": "fp8ref.spec.quant",
    "fp8ref.gemm": "fp8ref.spec.gemm",
    "fp8ref.bounds": "fp8ref.spec.bounds",
}


class _MovedModuleFinder:
    """Resolves an old module name from ``MOVED_MODULES`` to the module at its new place."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        new = MOVED_MODULES.get(name)
        if new is None:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(name, _MovedModuleFinder(), origin=new)

    @staticmethod
    def create_module(spec):
        import importlib
        import warnings

        warnings.warn(f"{spec.name} moved to {spec.origin}; import that instead ({spec.name} goes in fp8ref 0.3)",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(spec.origin)
        _sys.modules[spec.name] = module
        return module

    @staticmethod
    def exec_module(module):
        pass


import sys as _sys  # noqa: E402

if not any(isinstance(f, _MovedModuleFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_MovedModuleFinder())

__all__ = [
    "Backend",
    "NonFinite",
    "ScaleLayout",
    "RAISE",
    "PROPAGATE",
    "SPEC_NON_FINITE",
    "BackendInfo",
    "Case",
    "backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
    "Accumulation",
    "DEFAULT_AMAX_FLOOR",
    "E4M3FN",
    "E4M3FNUZ",
    "E5M2",
    "FORMATS",
    "FP8_BLOCK",
    "FP8_BLOCK_UE8M0",
    "FP8_DYNAMIC",
    "FP8_PER_TENSOR",
    "MXFP8",
    "MXFP8_E5M2",
    "Fp8Format",
    "Granularity",
    "PrecisionClass",
    "QuantScheme",
    "Quantized",
    "RECIPES",
    "Recipe",
    "W8A8_FP8",
    "W8A8_FP8_ROCM",
    "dequantize",
    "gamma",
    "gemm_error_bound",
    "get_format",
    "get_recipe",
    "linear_error_bound",
    "precision_class",
    "quantization_error_bound",
    "quantize",
    "reference_gemm_error_bound",
    "reference_linear",
    "linear",
    "moe",
    "moe_reference",
    "moe_error_bound",
    "MoeScheme",
    "MoeWeights",
    "Routing",
    "MoeAccuracy",
    "MoeBackend",
    "quantize_experts",
    "get_moe_backend",
    "moe_backends",
    "register_moe_backend",
    "explain",
    "Fp8Linear",
    "QuantizeSummary",
    "quantize_model",
    "CheckpointError",
    "save_fp8_dynamic",
    "load_fp8_dynamic",
    "BackendUnavailableError",
    "Decision",
    "NoCompliantBackendError",
    "clear_selection_cache",
    "select_backend",
    "choose_backend",
    "scaled_mm",
    "scaled_mm_exact",
]
