"""Decode (M = 1) GEMV bandwidth as a fraction of a read-only stream over the same bytes.

At M = 1 a linear reads its whole weight once per token and does two FLOPs per weight byte: its
ceiling is the memory's read bandwidth, not the GEMM peak, and a copy (read + write) is the wrong
yardstick. ``bench_gemv`` takes one Llama-3.1-8B decoder layer's seven weights (218 MB of FP8
codes, more than any last-level cache of the CPUs fp8ref runs on, so every call streams them from
memory; the codes of standard normal rows quantized per row, as a model's weights are, or with
``codes="uniform"`` a worst case: ``_random_weight``), and times in paired rounds
(``timing.paired``) the seven GEMVs of ``fp8ref.linear`` against a read-only pass over the same
codes (an int64 sum of each weight's bytes): the fraction is the stream's time over the GEMVs'
(1.0: the GEMVs read the weights as fast as a plain read does).
The target is ``GEMV_TARGET``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..api import linear
from ..spec.quant import Quantized, quantize
from ..spec.schemes import W8A8_FP8
from .timing import paired

__all__ = ["LLAMA8B_LAYER", "GEMV_TARGET", "last_level_cache_bytes", "bench_gemv"]

#: (K, N) of one Llama-3.1-8B decoder layer's linears: q, k, v, o, gate, up, down.
LLAMA8B_LAYER = ((4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336),
                 (14336, 4096))
#: The decode GEMVs' bandwidth as a fraction of the read-only stream that issue 42 asks for.
GEMV_TARGET = 0.85


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache the kernel reports (``/sys/devices/system/cpu/cpu0/cache``), or None."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def _random_weight(N: int, K: int, g: torch.Generator, codes: str = "quantized") -> Quantized:
    """A quantized weight's bytes, made a block of rows at a time (never a float weight four times
    their size): ``codes="quantized"``, ``fp8ref.quantize`` of standard normal rows, per-row scales
    (what a trained or randomly initialised weight gives: its small values are few, about 0.3 % of
    32-code groups hold a zero or subnormal code); ``"uniform"``, magnitudes uniform over the finite
    codes with random signs (8 of 127 magnitudes are zero or subnormal, so 7 in 8 groups hold one:
    a worst case for kernels that decode such groups apart)."""
    if codes == "uniform":
        c = torch.randint(0, 0x7F, (N, K), dtype=torch.uint8, generator=g)
        c |= (torch.randint(0, 2, (N, K), dtype=torch.uint8, generator=g) << 7)
        return Quantized(c.view(torch.float8_e4m3fn), torch.full((N, 1), 2.0**-9), W8A8_FP8.weight)
    if codes != "quantized":
        raise ValueError(f"codes must be 'quantized' or 'uniform', got {codes!r}")
    c = torch.empty(N, K, dtype=torch.uint8)
    scale = torch.empty(N, 1)
    rows = max(1, (1 << 22) // max(K, 1))  # 16 MiB of fp32 at a time
    for r in range(0, N, rows):
        q = quantize(torch.randn(min(rows, N - r), K, generator=g), W8A8_FP8.weight)
        c[r:r + q.data.shape[0]] = q.data.view(torch.uint8)
        scale[r:r + q.data.shape[0]] = q.scale
    return Quantized(c.view(torch.float8_e4m3fn), scale, W8A8_FP8.weight)


def bench_gemv(device: str = "cpu", shapes: Sequence[tuple[int, int]] = LLAMA8B_LAYER, *, backend: str = "auto",
               repeat: int = 5, budget_s: float = 3.0, log: Callable[[str], None] = lambda s: None,
               codes: str = "quantized") -> dict:
    """Decode GEMVs against a read-only stream over the same weight bytes (see the module).

    Returns
    -------
    dict
        ``bytes`` (the codes and scales read per pass), ``llc_bytes``, ``fits_in_cache`` (then the
        figure is not the memory's), ``gemv_gbps`` and ``stream_gbps`` (from the paired medians),
        ``fraction_of_stream`` (median of per-round stream/GEMV time ratios), ``target``,
        ``rounds``, ``backend`` (as asked), ``codes`` (``_random_weight``'s: ``"quantized"``, the
        weights of a model; ``"uniform"``, a worst case).

    Examples
    --------
    >>> from fp8ref.bench.gemv import bench_gemv
    >>> r = bench_gemv(shapes=[(64, 32)], backend="reference", repeat=1, budget_s=0.1)
    >>> r["fraction_of_stream"] > 0, r["fits_in_cache"]
    (True, True)
    """
    g = torch.Generator().manual_seed(0)
    weights = [_random_weight(N, K, g, codes) for K, N in shapes]
    if device != "cpu":
        weights = [Quantized(w.data.to(device), w.scale.to(device), w.scheme) for w in weights]
    xs = [torch.randn(1, K, generator=g).to(device=device, dtype=torch.bfloat16) for K, _ in shapes]
    words = [w.data.view(torch.uint8).reshape(-1).view(torch.int64) if w.data.numel() % 8 == 0
             else w.data.view(torch.uint8).reshape(-1) for w in weights]
    nbytes = sum(w.data.numel() + w.scale.numel() * w.scale.element_size() for w in weights)
    with torch.no_grad():
        for x, w in zip(xs, weights, strict=True):
            linear(x, w, backend=backend)  # selects and prepares, untimed

        def gemvs():
            for x, w in zip(xs, weights, strict=True):
                linear(x, w, backend=backend)

        def stream():
            for v in words:
                v.sum()

        log(f"  decode GEMV, {len(shapes)} weights, {nbytes / 1e6:.0f} MB")
        p = paired(stream, gemvs, device=device, repeat=repeat, budget_s=budget_s)
    llc = last_level_cache_bytes()
    return {"bytes": nbytes, "llc_bytes": llc, "fits_in_cache": llc is None or nbytes <= llc,
            "gemv_gbps": nbytes / p.timing.median_s / 1e9, "stream_gbps": nbytes / p.base.median_s / 1e9,
            "fraction_of_stream": p.ratio, "target": GEMV_TARGET, "rounds": p.rounds, "backend": backend,
            "codes": codes}


def format_gemv(r: dict) -> str:
    """One line for ``fp8ref bench``'s report."""
    cache = " (weights fit in the last-level cache: not a memory figure)" if r["fits_in_cache"] else ""
    met = "met" if r["fraction_of_stream"] >= r["target"] else "not met"
    if r.get("codes", "quantized") == "uniform":
        return (f"  worst case, uniform codes (7 in 8 groups of 32 hold a zero or subnormal code): "
                f"{r['gemv_gbps']:.2f} GB/s, {100 * r['fraction_of_stream']:.1f} % of {r['stream_gbps']:.2f} "
                f"GB/s{cache}")
    return (f"decode GEMV ({r['backend']}, M = 1, {r['bytes'] / 1e6:.0f} MB of quantized normal weights): "
            f"{r['gemv_gbps']:.2f} GB/s, {100 * r['fraction_of_stream']:.1f} % of a read-only stream over the same "
            f"bytes ({r['stream_gbps']:.2f} GB/s; target >= {100 * r['target']:.0f} %: {met}){cache}")
