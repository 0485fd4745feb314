"""The backends: real FP8 implementations, one module each, every one checked against the spec.

``reference`` (the spec itself, the fallback), ``torch_mm`` (``torch._scaled_mm``), ``cpu``
(cpu-bf16 and cpu-fp32), ``cpu_fp8`` (a C++ kernel that reads the FP8 weights), ``triton_kernels``
and ``sgl`` (sgl-kernel); ``_common`` holds their shared helpers and ``native`` loads and builds
the C++ extension whose sources are in ``csrc/``. Each module registers its backend on import;
``fp8ref.registry`` imports them lazily. Imports flow from the spec and the registry into this
package, never back: nothing below the selector imports a backend module.
"""
