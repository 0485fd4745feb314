"""Quantization speed: GB/s of every backend's ``quantize`` per scheme, as a fraction of the copy bandwidth."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..registry import Backend
from ..spec.schemes import FP8_BLOCK, W8A8_FP8, QuantScheme
from .backends import resolve_backend
from .timing import PAST_DEADLINE, cycler, paired, past, rotation, timeit

__all__ = ["QUANT_SCHEMES", "quant_bytes", "bench_quantization"]

#: (name, tensor role, scheme) of every quantization measured. Activations are [M, K], weights [N, K].
QUANT_SCHEMES: tuple[tuple[str, str, QuantScheme], ...] = (
    ("per-token", "activation", W8A8_FP8.activation),
    ("per-group128", "activation", FP8_BLOCK.activation),
    ("per-tensor", "activation", QuantScheme(granularity="tensor")),
    ("per-channel", "weight", W8A8_FP8.weight),
    ("block128x128", "weight", FP8_BLOCK.weight),
)


def quant_bytes(rows: int, cols: int, in_dtype: torch.dtype, scheme: QuantScheme) -> int:
    """Fewest bytes a quantizer moves: the input read once, FP8 codes and scales written once.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.bench import quant_bytes
    >>> from fp8ref import QuantScheme
    >>> quant_bytes(2, 128, torch.bfloat16, QuantScheme())  # 512 in + 256 codes + 2 fp32 scales
    776
    """
    sr, sc = scheme.scale_shape(rows, cols)
    in_size = torch.empty((), dtype=in_dtype).element_size()
    scale_size = torch.empty((), dtype=scheme.scale_dtype).element_size()
    return rows * cols * (in_size + 1) + sr * sc * scale_size


def bench_quantization(device: str = "cpu", backend_names: Sequence[str | Backend] = ("reference",), *,
                       act_shape: tuple[int, int] = (1024, 4096), weight_shape: tuple[int, int] = (4096, 4096),
                       copy_gbps: float | None = None, copy_bytes: int | None = None, repeat: int = 5,
                       budget_s: float = 2.0, deadline: float | None = None,
                       log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """GB/s of every backend's ``quantize`` for each entry of ``QUANT_SCHEMES``.

    Each row holds ``gbps`` (``quant_bytes`` / median seconds) and, when ``copy_gbps`` is given,
    ``frac_of_copy``. A backend that does not implement a scheme gets a row with ``skipped``, as
    does every measurement after ``deadline`` (a ``time.perf_counter()`` value) has passed.

    With ``copy_bytes``, each quantization is also timed against a copy of ``copy_bytes`` bytes
    (``dst.copy_(src)``, the copy ceiling's operation; 256 MiB on CPU is far beyond the caches) in
    back-to-back rounds (``paired``): ``frac_of_copy_paired`` is the median over rounds of the
    quantizer's GB/s over the copy's GB/s (read + write) in the same round, and
    ``copy_gbps_paired`` the copy's median GB/s. The ceiling's ``copy_gbps`` is measured once per
    run, and on a machine whose bandwidth drifts (docs/performance.md: by nearly 2x within an hour)
    the ratio to it carries the drift; the paired ratio cancels it (not a loss of CPU time to other
    tenants, which slows the quantizer more than the copy). The paired copy is the round's sample,
    the ceiling the best of its samples: the ceiling is the stricter of the two.

    Examples
    --------
    >>> from fp8ref.bench import bench_quantization
    >>> rows = bench_quantization("cpu", ["reference"], act_shape=(2, 128), weight_shape=(128, 128),
    ...                           copy_gbps=10.0, repeat=1, budget_s=0.05)
    >>> [(r["quant"], r["bytes"]) for r in rows[:2]]
    [('per-token', 776), ('per-group128', 776)]
    """
    rows = []
    copy = None
    if copy_bytes is not None:
        if copy_bytes < 1:
            raise ValueError(f"copy_bytes must be >= 1, got {copy_bytes}")
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_(0, 255)
        dst = torch.empty_like(src)
        copy = (lambda: dst.copy_(src))  # noqa: E731  (one closure over both buffers)
    for bname, backend in map(resolve_backend, backend_names):
        for qname, role, scheme in QUANT_SCHEMES:
            r, c = act_shape if role == "activation" else weight_shape
            row: dict[str, Any] = {"backend": bname, "quant": qname, "role": role, "scheme": scheme.short_str(),
                                   "shape": [r, c], "dtype": "bfloat16"}
            nbytes = quant_bytes(r, c, torch.bfloat16, scheme)
            if past(deadline):
                row["skipped"] = PAST_DEADLINE
                rows.append(row)
                continue
            sets = [torch.randn(r, c, device=device, dtype=torch.bfloat16)
                    for _ in range(rotation(r * c * 2, device))]
            nxt = cycler(sets)
            try:
                backend.quantize(sets[0], scheme)
            except Exception as exc:  # NotImplementedError or a declined scheme: say which
                row["skipped"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                log(f"  quantize {bname:12} {qname:13} skipped: {row['skipped']}")
                continue
            fn = lambda nxt=nxt, scheme=scheme, backend=backend: backend.quantize(nxt(), scheme)  # noqa: E731
            t = timeit(fn, device=device, repeat=repeat, budget_s=budget_s)
            row.update(bytes=nbytes, seconds=t.median_s, gbps=nbytes / t.median_s / 1e9, timing=t.as_dict())
            if copy_gbps:
                row["frac_of_copy"] = row["gbps"] / copy_gbps
            if copy is not None:
                # t_copy / t_quant per round, times the byte ratio: (quant GB/s) / (copy GB/s) per round
                p = paired(copy, fn, device=device, repeat=repeat, budget_s=budget_s)
                row.update(frac_of_copy_paired=p.ratio * nbytes / (2 * copy_bytes),
                           copy_gbps_paired=2 * copy_bytes / p.base.median_s / 1e9, paired_rounds=p.rounds)
            rows.append(row)
            paired_note = (f"  ({100 * row['frac_of_copy_paired']:.0f} % of a copy in the same rounds)"
                           if "frac_of_copy_paired" in row else "")
            log(f"  quantize {bname:12} {qname:13} {row['gbps']:8.2f} GB/s{paired_note}")
    return rows
