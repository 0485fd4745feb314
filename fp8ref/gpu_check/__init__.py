"""The prepared GPU evidence run: conformance, accumulator width and speed on a lent NVIDIA GPU.

``python -m fp8ref.gpu_check --out DIR`` (or ``scripts/gpu_check.sh DIR``), with no network and
in under 8 minutes on one GPU:

1. runs the conformance suite (``fp8ref.conformance.check``) on every backend that runs on CUDA
   (``torch`` with and without fast accumulation, ``triton``, ``sgl-kernel`` if importable),
   each in a child process with a time limit, so a hung kernel costs its slot, not the run;
2. measures ``fp8ref.conformance.accumulator_bits`` of ``torch._scaled_mm`` with fast
   accumulation off (``torch``) and on (``torch-fast``);
3. benchmarks FP8 against bf16 GEMM at the Llama-3.1-8B shapes and the quantization kernels
   against a device-to-device copy (``fp8ref.bench``);
4. evaluates the targets (``TARGETS``) as pass/fail and writes ``gpu_check.json`` and
   ``summary.md`` to the output directory after every step, so a cut-off run keeps what it did.

Exit status: 0 when every target passed (or, on ``--device cpu``, the dry run completed), 1 when
a target failed or could not be evaluated or a step errored, 2 when the run could not start (no
CUDA device). ``--device cpu`` runs the same pipeline on the CPU as a dry run: its targets are
printed for the pipeline's sake only, since they are stated for an H200.

Modules: ``cli`` (arguments and the run), ``steps`` (what is measured, and the child processes),
``targets`` (pass/fail) and ``summary`` (the JSON and Markdown files). Imports flow from
``steps``, ``targets`` and ``summary`` to ``cli``; the package sits on top of ``fp8ref.bench``, the
registry and (in the child processes) ``fp8ref.conformance``, and nothing in fp8ref imports it.
"""

from .cli import EXIT_FAILED, EXIT_NO_DEVICE, EXIT_OK, build_parser, main
from .steps import GPU_BACKENDS, OnDevice, cuda_backends
from .summary import summary_markdown, write_json, write_summary
from .targets import ACT_QUANTS, TARGETS, evaluate_targets, overall

__all__ = ["TARGETS", "ACT_QUANTS", "GPU_BACKENDS", "EXIT_OK", "EXIT_FAILED", "EXIT_NO_DEVICE", "build_parser",
           "evaluate_targets", "overall", "write_json", "write_summary", "summary_markdown", "cuda_backends",
           "OnDevice", "main"]
