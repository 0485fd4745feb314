"""The whole ``fp8ref bench`` run: every section on one device, as one JSON-able dict."""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._machine import cpu_flags, cpu_kind, cpu_model, cpu_signature
from ..kernels.cpu_fp8 import gemm_path
from ..kernels.cpu_fp8_amx import self_test_summary
from ..registry import get_backend
from .backends import available_backends
from .ceilings import bf16_gemm_peak, copy_bandwidth
from .conformance import bench_conformance
from .gemv import LLAMA8B_LAYER, bench_gemv
from .linear import LLAMA3_8B_SHAPES, M_VALUES, bench_linear
from .load import unreliable_reason
from .quantization import bench_quantization
from .reference import bench_reference
from .selector import bench_selector
from .timing import is_cuda

__all__ = ["SECTIONS", "KERNEL_FLAGS", "run", "machine_meta", "kernel_paths"]

#: The sections of a run, in the order they run.
SECTIONS = ("ceilings", "quant", "linear", "gemv", "reference", "selector", "conformance")


#: The CPU flags that decide kernel paths (``/proc/cpuinfo`` names), recorded with every run.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile",
                "amx_bf16", "amx_int8")


def kernel_paths() -> dict[str, str]:
    """Which code path fp8ref's own CPU kernels take on this CPU, or why one cannot run: cpu-fp8's
    path (``gemm_path``, from the CPU's flags) and whether cpu-fp8-amx runs on AMX tiles."""
    amx = get_backend("cpu-fp8-amx").available()
    return {"cpu-fp8": f"{gemm_path()} kernel",
            "cpu-fp8-amx": f"AMX tiles ({self_test_summary()})" if amx is None else f"not run: {amx}"}


def machine_meta(device: str, quick: bool) -> dict:
    """What a run was measured on and when: date, device, CPU model, kind, vendor, family and model
    number (two CPUs of one kind and model name, of two generations, differ), kernel
    flags, torch, Python, CPUs, threads, load."""
    flags = cpu_flags()
    sig = cpu_signature()
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "quick": quick,
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_vendor": sig["vendor"],
        "cpu_family": sig["family"],
        "cpu_model_number": sig["model"],
        "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if hasattr(os, "getloadavg"):
        meta["loadavg_start"] = list(os.getloadavg())
    if not is_cuda(device):
        meta["kernel_paths"] = kernel_paths()
    if is_cuda(device):
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
    return meta


def run(device: str = "cpu", *, quick: bool = False, backends_only: Sequence[str] | None = None,
        shapes: Sequence[tuple[int, int]] | None = None, m_values: Sequence[int] | None = None,
        sections: Sequence[str] = SECTIONS,
        gemm_only: bool | None = None, deadline_s: float | None = None,
        log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the benchmarks on ``device`` and return every figure as one JSON-able dict.

    Parameters
    ----------
    device : {"cpu", "cuda"}
    quick : bool
        One shape (K = N = 4096), M in {1, 16}, smaller quantization tensors, fewer samples.
    backends_only : sequence of str, optional
        Restrict to these backends (default: every backend available on ``device``).
    shapes, m_values : optional
        Override the (K, N) shapes and the M values of the linear benchmark.
    sections : sequence of str
        Any of ``ceilings, quant, linear, reference, selector, conformance``.
    gemm_only : bool, optional
        Also time the FP8 GEMM alone (default: on CUDA only).
    deadline_s : float, optional
        Seconds from the start after which quantization and linear measurements are skipped
        (marked so in the result) instead of run.
    log : callable
        Receives one progress line at a time.

    Examples
    --------
    >>> from fp8ref import bench
    >>> r = bench.run("cpu", quick=True, backends_only=["reference"], shapes=[(256, 128)], m_values=[1],
    ...               sections=("ceilings", "linear"))
    >>> r["linear"][0]["backends"]["reference"]["speedup_vs_bf16"] > 0
    True
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}")
    device = dev.type
    cuda = device == "cuda"
    if gemm_only is None:
        gemm_only = cuda
    repeat = 3 if quick else (10 if cuda else 5)
    # Seconds of samples per measurement, and the per-call time beyond which a backend is not
    # run at larger M: on a CPU the float64 reference and the fp32-widening torch._scaled_mm take
    # seconds per call at these shapes, and would otherwise dominate the run.
    budget = 0.5 if quick else (2.0 if cuda else 1.5)
    max_call_s = 0.5 if quick else (2.0 if cuda else 1.0)
    shapes = list(shapes) if shapes is not None else ([(4096, 4096)] if quick else list(LLAMA3_8B_SHAPES))
    m_values = list(m_values) if m_values is not None else ([1, 16] if quick else list(M_VALUES))
    names, skipped = available_backends(device, backends_only)
    res: dict[str, Any] = {"meta": machine_meta(device, quick), "backends": names, "backends_skipped": skipped,
                           "config": {"shapes": [list(s) for s in shapes], "m_values": m_values,
                                      "sections": list(sections), "repeat": repeat, "budget_s": budget,
                                      "max_call_s": max_call_s}}
    t_start = time.perf_counter()
    deadline = None if deadline_s is None else t_start + deadline_s
    copy_gbps = peak = None
    if "ceilings" in sections:
        log("ceilings")
        res["copy"] = copy_bandwidth(device, (64 << 20) if quick and not cuda else None, repeat=repeat,
                                     budget_s=budget)
        res["bf16_peak"] = bf16_gemm_peak(device, (2048,) if quick and not cuda else None, repeat=repeat,
                                          budget_s=budget)
        copy_gbps, peak = res["copy"]["gbps"], res["bf16_peak"]["gflops"]
        log(f"  copy {copy_gbps:.1f} GB/s, bf16 GEMM peak {peak:.1f} GFLOP/s")
    if "quant" in sections:
        log("quantization")
        if cuda:
            act, wt = (16384, 4096), (14336, 4096)
        elif quick:
            # The activation and (a slice of) the weight of the first linear shape.
            k0, n0 = shapes[0]
            act, wt = (128, k0), (min(n0, 1024), k0)
        else:
            act, wt = (1024, 4096), (4096, 4096)
        res["quant"] = bench_quantization(device, names, act_shape=act, weight_shape=wt, copy_gbps=copy_gbps,
                                          copy_bytes=res["copy"]["bytes"] if "copy" in res else None, repeat=repeat,
                                          budget_s=0.2 if quick else min(budget, 1.0), deadline=deadline, log=log)
    if "linear" in sections:
        log("linear")
        res["linear"] = bench_linear(device, names, shapes=shapes, m_values=m_values, peak_gflops=peak,
                                     gemm_only=gemm_only, repeat=repeat, budget_s=budget,
                                     max_call_s=max_call_s, deadline=deadline, log=log)
    if "gemv" in sections:
        log("decode GEMV against a read-only stream")
        res["gemv"] = bench_gemv(device, LLAMA8B_LAYER[:1] if quick else LLAMA8B_LAYER, repeat=repeat,
                                 budget_s=budget, log=log)
        if not quick:  # the worst case of the kernels that decode zero/subnormal groups apart
            res["gemv_uniform"] = bench_gemv(device, LLAMA8B_LAYER, repeat=repeat, budget_s=budget, log=log,
                                             codes="uniform")
    if "reference" in sections:
        log("reference")
        res["reference"] = bench_reference(device, repeat=1 if quick else 3, budget_s=3.0 if quick else 6.0,
                                           log=log)
    if "selector" in sections:
        log("selector")
        k0, n0 = shapes[0]
        res["selector"] = bench_selector(device, K=min(k0, 1024) if quick else k0, N=min(n0, 1024) if quick else n0,
                                         repeat=5 if quick else 20, budget_s=budget)
    if "conformance" in sections:
        log("conformance")
        # --quick: one backend, to show the suite's throughput without spending the minute on it.
        res["conformance"] = bench_conformance(names[:1] if quick else names, profile="dev",
                                               max_examples=2 if quick else None, log=log)
    res["meta"]["elapsed_s"] = time.perf_counter() - t_start
    if hasattr(os, "getloadavg"):
        res["meta"]["loadavg_end"] = list(os.getloadavg())
    res["meta"]["unreliable"] = unreliable_reason(res["meta"])
    return res
