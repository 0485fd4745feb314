"""The GPU run's measurements: which backends it certifies, the ``OnDevice`` wrapper that puts the
conformance suite's CPU inputs on the GPU, and one conformance or accumulator-bits task per
backend in a child process with a time limit (so a hung kernel costs its slot, not the run)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..bench import available_backends
from ..registry import Backend, Case, backend_quantize, get_backend
from ..spec.quant import Quantized

__all__ = ["GPU_BACKENDS", "cuda_backends", "OnDevice", "worker", "run_task"]

#: Backends the GPU run certifies when they are registered and available.
GPU_BACKENDS = ("torch", "torch-fast", "triton", "sgl-kernel")


def cuda_backends(device: str = "cuda", only: Sequence[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Backends to certify on ``device`` (the reference excluded: it is the spec) and why others are not.

    Every name in ``GPU_BACKENDS`` appears in one of the two results, registered or not.
    """
    names, skipped = available_backends(device, only)
    names = [n for n in names if n != "reference"]
    for b in GPU_BACKENDS:
        if (only is None or b in only) and b not in names and b not in skipped:
            skipped[b] = "not registered (its module is missing or failed to import)"
    return names, skipped


class OnDevice(Backend):
    """A backend run on ``device`` for a suite that builds its inputs on the CPU.

    ``fp8ref.conformance.check`` draws its examples as CPU tensors; certifying a CUDA kernel
    needs them on the GPU. This wrapper moves every input to ``device``, calls the wrapped
    backend, and brings the results back, so the CUDA kernel is what the contracts check. It
    keeps the wrapped backend's name and declarations (accumulation, output roundings), and asks
    ``supports`` about the case on ``device``.

    Examples
    --------
    >>> import torch
    >>> from fp8ref import get_backend, quantize
    >>> from fp8ref.gpu_check import OnDevice
    >>> b = OnDevice(get_backend("reference"), "cpu")
    >>> b.name, b.precision.value
    ('reference', 'exact')
    >>> a = quantize(torch.full((2, 16), 448.0))  # scale 1: every product exact
    >>> b.scaled_mm(a, b.prepare_weight(a), None, torch.float32).tolist()
    [[3211264.0, 3211264.0], [3211264.0, 3211264.0]]
    """

    def __init__(self, backend: Backend, device: str):
        self.inner, self.device = backend, torch.device(device)
        self.name, self.accumulation = backend.name, backend.accumulation
        self.output_roundings = backend.output_roundings

    def available(self) -> str | None:
        return self.inner.available()

    def supports(self, case: Case) -> str | None:
        return self.inner.supports(replace(case, device=self.device.type))

    def _to(self, q: Quantized, device) -> Quantized:
        return Quantized(q.data.to(device), q.scale.to(device), q.scheme, q.n_saturated)

    def quantize(self, x: torch.Tensor, scheme, scale=None) -> Quantized:
        scale = None if scale is None else scale.to(self.device)
        return self._to(backend_quantize(self.inner, x.to(self.device), scheme, scale), x.device)

    def prepare_weight(self, w: Quantized) -> Any:
        return self.inner.prepare_weight(self._to(w, self.device))

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if isinstance(b, Quantized):
            b = self._to(b, self.device)
        y = self.inner.scaled_mm(self._to(a, self.device), b, None if bias is None else bias.to(self.device),
                                 out_dtype)
        return y.to(a.data.device)


def worker(task: str, backend: str, profile: str, device: str) -> dict:
    """One conformance or accumulator-bits measurement, as a JSON-able dict (never raises)."""
    try:
        from .. import conformance
    except ImportError as exc:
        if (exc.name or "").startswith("fp8ref"):
            raise  # our own module: a bug, not a missing extra
        return {"backend": backend, "status": "not available",
                "reason": f"fp8ref.conformance needs the conformance extra (pip install 'fp8ref[conformance]'): {exc}"}
    t0 = time.perf_counter()
    try:
        be = get_backend(backend)
        if task == "conformance":
            # The suite builds CPU inputs: certify the CUDA kernel, not the backend's CPU path.
            report = conformance.check(be if device == "cpu" else OnDevice(be, device), profile)
        else:
            bits = conformance.accumulator_bits(be, device=device)
    except Exception as exc:  # the error is the finding
        return {"backend": backend, "status": "error", "reason": f"{type(exc).__name__}: {exc}",
                "seconds": time.perf_counter() - t0}
    out = {"backend": backend, "status": "ok", "seconds": time.perf_counter() - t0}
    if task != "conformance":
        return out | {"bits": bits}
    out.update(report=report.to_dict(), passed=report.passed, examples=sum(r.examples for r in report.results),
               failures=[f"{r.contract} ({r.status})" for r in report.failures],
               accumulator_bits=report.accumulator_bits)
    if not report.available:
        out["status"], out["reason"] = "unavailable", report.reason
    return out


def run_task(task: str, backend: str, profile: str, device: str, *, timeout_s: float, in_process: bool) -> dict:
    """``worker``'s answer, from a child process killed after ``timeout_s`` (or in this process)."""
    if in_process:
        return worker(task, backend, profile, device)
    cmd = [sys.executable, "-m", "fp8ref.gpu_check", "--worker", task, backend, profile, device]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        return {"backend": backend, "status": "timeout", "reason": f"no answer within {timeout_s:.0f} s",
                "seconds": time.perf_counter() - t0}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"backend": backend, "status": "error", "seconds": time.perf_counter() - t0,
                "reason": f"worker exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])
