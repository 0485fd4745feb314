"""Benchmarks as ratios: every speed is measured against a ceiling taken in the same run.

Absolute times depend on the machine and on whatever else runs on it; ratios taken in one run
are what can be compared. On one device (``cpu`` or ``cuda``) this package measures the two
ceilings (memory-copy bandwidth, the peak of a large bf16 GEMM); quantization in GB/s as a
fraction of the copy; ``linear`` of every available backend and of ``auto`` at the Llama-3.1-8B
layer shapes as a speed-up over bf16 ``F.linear`` and a fraction of the GEMM peak; the selector's
dispatch overhead and first-selection time; the conformance suite's throughput; and the
reference itself. ``run`` returns one JSON-able dict and ``format_report`` turns it into the
table ``fp8ref bench`` prints. Timings never gate anything here: targets are evaluated as ratios
by ``fp8ref.gpu_check``, and the pytest-benchmark files in ``benchmarks/`` reuse the pieces.

One module per section: ``timing`` (``timeit`` and what every section shares), ``ceilings``,
``backends`` (which backends run), ``quantization``, ``linear``, ``reference``, ``selector``,
``conformance``, then ``runner`` (the whole run) and ``report`` (the tables). Imports flow from
``timing`` and ``backends`` to the sections to ``runner``; the package imports the spec, the
registry, the selector and ``fp8ref.api`` (and ``fp8ref.conformance`` when the conformance section
runs), and nothing imports it but the CLI and ``fp8ref.gpu_check``.
"""

from .backends import available_backends
from .ceilings import bf16_gemm_peak, copy_bandwidth
from .conformance import bench_conformance
from .linear import LLAMA3_8B_SHAPES, M_VALUES, bench_linear
from .quantization import QUANT_SCHEMES, bench_quantization, quant_bytes
from .reference import bench_reference
from .report import format_report
from .runner import SECTIONS, machine_meta, run
from .selector import bench_selector
from .timing import Paired, Timing, paired, timeit

__all__ = [
    "LLAMA3_8B_SHAPES",
    "M_VALUES",
    "QUANT_SCHEMES",
    "SECTIONS",
    "Paired",
    "Timing",
    "paired",
    "timeit",
    "available_backends",
    "copy_bandwidth",
    "bf16_gemm_peak",
    "quant_bytes",
    "bench_quantization",
    "bench_linear",
    "bench_reference",
    "bench_selector",
    "bench_conformance",
    "machine_meta",
    "run",
    "format_report",
]
