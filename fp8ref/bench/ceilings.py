"""The two ceilings every speed is a fraction of, measured in the same run: memory-copy bandwidth
and the peak of a large bf16 GEMM."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .timing import is_cuda, timeit

__all__ = ["copy_bandwidth", "bf16_gemm_peak"]


def copy_bandwidth(device: str = "cpu", nbytes: int | None = None, *, repeat: int = 5,
                   budget_s: float = 2.0) -> dict:
    """Measured memory-copy bandwidth: bytes read + bytes written per second of ``dst.copy_(src)``.

    The best sample, since a ceiling is the most the machine did. On CUDA this is the
    device-to-device copy (HBM) bandwidth. The buffers default to 1 GiB on
    CUDA (well beyond the L2) and 256 MiB on CPU.

    Examples
    --------
    >>> from fp8ref.bench import copy_bandwidth
    >>> copy_bandwidth("cpu", 1 << 20, repeat=2)["gbps"] > 0
    True
    """
    if nbytes is None:
        nbytes = (1 << 30) if is_cuda(device) else (256 << 20)
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device=device, repeat=repeat, budget_s=budget_s)
    return {"bytes": nbytes, "bytes_moved": 2 * nbytes, "gbps": 2 * nbytes / t.min_s / 1e9,
            "timing": t.as_dict()}


def bf16_gemm_peak(device: str = "cpu", sizes: Sequence[int] | None = None, *, repeat: int = 5,
                   budget_s: float = 2.0) -> dict:
    """Measured bf16 GEMM peak: the best FLOP/s of square bf16 ``F.linear`` over ``sizes``.

    ``F.linear`` (``a @ b.T``) because it is the baseline every linear is compared with; the best
    sample (not the median), because a ceiling is the most the machine did. Random data (zeros
    run faster on some GPUs). Defaults: 4096 and 8192 on CUDA, 2048 and 4096 on CPU.

    Examples
    --------
    >>> from fp8ref.bench import bf16_gemm_peak
    >>> bf16_gemm_peak("cpu", [64], repeat=2)["gflops"] > 0
    True
    """
    if sizes is None:
        sizes = (4096, 8192) if is_cuda(device) else (2048, 4096)
    if not sizes or any(int(s) < 1 for s in sizes):
        raise ValueError(f"sizes must be positive ints, got {sizes!r}")
    per = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        t = timeit(lambda a=a, b=b: F.linear(a, b), device=device, repeat=repeat, budget_s=budget_s)
        per.append({"n": int(n), "gflops": 2 * n**3 / t.min_s / 1e9, "timing": t.as_dict()})
        del a, b
    best = max(per, key=lambda r: r["gflops"])
    return {"gflops": best["gflops"], "n": best["n"], "per_size": per}
