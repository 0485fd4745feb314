"""The backends: real FP8 implementations, one module each, every one checked against the spec.

``reference`` (the spec itself, the fallback), ``torch_mm`` (``torch._scaled_mm``), ``cpu``
(cpu-bf16 and cpu-fp32), ``cpu_fp8`` (a C++ kernel that reads the FP8 weights), ``cpu_fp8_amx``
(the same on AMX tiles), ``triton_kernels`` (its kernels in ``_triton_defs``) and ``sgl``
(sgl-kernel); ``_common`` holds their shared helpers, ``native`` loads and builds the C++ extension
whose sources are in ``csrc/``, and ``build`` is its build command (``python -m
fp8ref.kernels.build``). Each backend module registers its backend on import; ``fp8ref.registry``
imports them lazily. Imports flow from the spec and the registry into this package, never back:
nothing below the selector imports a backend module. Inside it they flow from ``_common`` and
``native`` to the backends and from the backends to ``build``, with no cycle even through an
import inside a function (tests/test_layout.py).
"""
