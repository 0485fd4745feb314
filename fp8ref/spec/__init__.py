"""The spec: what FP8 W8A8 quantization and the scaled GEMM compute, bit for bit, and how far a
conforming implementation may stray.

A leaf: it imports nothing else from fp8ref. Its modules follow the dependency order
``fenv`` (subnormals kept whatever the caller's thread flushes) -> ``formats`` (the three FP8
formats) -> ``schemes`` (how a tensor is quantized, recipes) -> ``dense`` (the layout check) ->
``quant`` (the reference quantizer) -> ``gemm`` (the exact scaled GEMM) -> ``checks`` (the
argument checks of the calling contract, the one home every entry point imports) -> ``roundoff``
(unit roundoffs, Higham's gamma) -> ``quant_bounds`` (the scale tolerance and the quantization
bounds) -> ``bounds`` (the GEMM and end-to-end bounds, precision classes; it re-exports the two
before it) -> ``loading``
(what a loaded fused, tensor-parallel weight must dequantize to); ``compare`` (a
leaf on torch alone) is the one routine that judges a value against a reference and a bound,
returning a typed ``Verdict``: every contract, the selector's probe and the audits call it.
``docs/spec.md`` is the same contract in prose and equations.
"""
