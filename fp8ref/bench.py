"""Benchmarks as ratios: every speed is measured against a ceiling taken in the same run.

Absolute times depend on the machine and on whatever else runs on it; ratios taken in one run
are what can be compared. This module measures, on one device (``cpu`` or ``cuda``):

- the two ceilings: memory-copy bandwidth (bytes read + bytes written per second) and the peak
  of a large bf16 GEMM (FLOP/s);
- quantization (activations per token, per group of 128, per tensor; weights per channel and
  per 128x128 block) in GB/s and as a fraction of the copy bandwidth;
- ``linear`` of every available backend and of ``auto`` at the Llama-3.1-8B layer shapes, as a
  speed-up over bf16 ``F.linear`` and as a fraction of the bf16 GEMM peak;
- the selector's dispatch overhead and first-selection time, the conformance suite's
  throughput, and the reference itself (exact ``scaled_mm`` against fp32 ``F.linear``,
  ``quantize`` in GB/s).

``run`` returns one JSON-able dict; ``format_report`` turns it into the table ``fp8ref bench``
prints. The pytest-benchmark files in ``benchmarks/`` and ``fp8ref.gpu_check`` reuse the pieces.
Timings never gate anything here: targets are evaluated as ratios by ``fp8ref.gpu_check``.
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .registry import Backend, Case, backends, decline_reason, get_backend
from .spec import quant
from .spec.bounds import PrecisionClass
from .spec.schemes import FP8_BLOCK, W8A8_FP8, QuantScheme, Recipe, get_recipe

__all__ = [
    "LLAMA3_8B_SHAPES",
    "M_VALUES",
    "QUANT_SCHEMES",
    "Timing",
    "timeit",
    "copy_bandwidth",
    "bf16_gemm_peak",
    "quant_bytes",
    "bench_quantization",
    "bench_linear",
    "bench_reference",
    "bench_selector",
    "bench_conformance",
    "run",
    "format_report",
    "peer_api",
]

#: (K, N) of the Llama-3.1-8B linear layers: attention out-proj (and q), MLP up/gate, MLP down,
#: fused QKV (4096 + 2 * 1024 for the 8 KV heads of 128).
LLAMA3_8B_SHAPES: tuple[tuple[int, int], ...] = ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144))
#: Tokens per forward pass: decode (1), small and medium batches, prefill (1024).
M_VALUES: tuple[int, ...] = (1, 16, 128, 1024)

#: (name, tensor role, scheme) of every quantization measured. Activations are [M, K], weights [N, K].
QUANT_SCHEMES: tuple[tuple[str, str, QuantScheme], ...] = (
    ("per-token", "activation", W8A8_FP8.activation),
    ("per-group128", "activation", FP8_BLOCK.activation),
    ("per-tensor", "activation", QuantScheme(granularity="tensor")),
    ("per-channel", "weight", W8A8_FP8.weight),
    ("block128x128", "weight", FP8_BLOCK.weight),
)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timing:
    """Seconds per call of a timed function.

    Attributes
    ----------
    median_s, min_s : float
        Median and minimum over the samples, per call.
    samples : int
        Number of timed samples (each of ``inner`` back-to-back calls).
    inner : int
        Calls per sample, chosen so that one sample lasts at least ``min_sample_s`` (short calls
        are otherwise dominated by the timer and, on a GPU, by launch gaps).
    first_s : float
        Seconds of the first (warm-up) call: compilation, allocation and cache effects.
    """

    median_s: float
    min_s: float
    samples: int
    inner: int
    first_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _synchronizer(device: str | torch.device) -> Callable[[], None]:
    if _is_cuda(device):
        return torch.cuda.synchronize
    return lambda: None


def timeit(fn: Callable[[], Any], *, device: str | torch.device = "cpu", warmup: int = 1, repeat: int = 5,
           budget_s: float = 2.0, min_sample_s: float | None = None) -> Timing:
    """Median seconds per call of ``fn()`` after warm-up, synchronizing CUDA around each sample.

    Parameters
    ----------
    fn : callable
        Called with no arguments.
    device : str or torch.device
        Where ``fn`` runs; on CUDA every sample ends with ``torch.cuda.synchronize()``.
    warmup : int
        Untimed calls first (at least 1; the first call's time is reported as ``first_s``).
    repeat : int
        Samples to take (at least 1).
    budget_s : float
        Stop taking samples once this many seconds have passed (at least one is always taken),
        so that a slow backend costs a bounded time.
    min_sample_s : float, optional
        Smallest duration of one sample; shorter calls are repeated ``inner`` times per sample.
        Default 1 ms on CUDA, 5 ms on CPU.

    Returns
    -------
    Timing

    Examples
    --------
    >>> import torch
    >>> from fp8ref.bench import timeit
    >>> t = timeit(lambda: torch.ones(64).sum(), repeat=3)
    >>> t.samples, t.median_s > 0
    (3, True)
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if warmup < 1 or repeat < 1:
        raise ValueError(f"warmup and repeat must be >= 1, got warmup={warmup}, repeat={repeat}")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    sync = _synchronizer(device)
    if min_sample_s is None:
        min_sample_s = 1e-3 if _is_cuda(device) else 5e-3
    clock = time.perf_counter
    sync()
    t0 = clock()
    fn()
    sync()
    first = clock() - t0
    for _ in range(warmup - 1):
        fn()
    sync()
    start = clock()
    if first > budget_s or first >= min_sample_s:
        # A call long enough to time on its own needs no calibration call (for a slow backend
        # that call would cost as much as a sample); past the budget one sample is all we take.
        inner = 1
    else:
        t0 = clock()
        fn()
        sync()
        once = max(clock() - t0, 1e-9)
        inner = max(1, min(1000, math.ceil(min_sample_s / once)))
    samples: list[float] = []
    while len(samples) < repeat:
        t0 = clock()
        for _ in range(inner):
            fn()
        sync()
        samples.append((clock() - t0) / inner)
        if clock() - start > budget_s:
            break
    return Timing(statistics.median(samples), min(samples), len(samples), inner, first)


# --------------------------------------------------------------------------------------------
# The two ceilings
# --------------------------------------------------------------------------------------------

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
        nbytes = (1 << 30) if _is_cuda(device) else (256 << 20)
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
        sizes = (4096, 8192) if _is_cuda(device) else (2048, 4096)
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


# --------------------------------------------------------------------------------------------
# Peers' APIs (the selector, fp8ref.linear, the conformance suite) are looked up, not imported,
# so that the benchmarks run, and say what is missing, while those modules are absent.
# --------------------------------------------------------------------------------------------

def peer_api(module: str, attr: str) -> tuple[Any | None, str | None]:
    """``(object, None)`` for ``module.attr``, or ``(None, reason)`` when it does not exist (yet).

    Examples
    --------
    >>> from fp8ref.bench import peer_api
    >>> peer_api("fp8ref.spec.quant", "quantize")[1] is None
    True
    >>> peer_api("fp8ref.spec.quant", "no_such_thing")[1]
    'fp8ref.spec.quant.no_such_thing is not available: no attribute no_such_thing'
    """
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        return None, f"{module}.{attr} is not available: cannot import {module} ({exc})"
    obj = getattr(mod, attr, None)
    if obj is None:
        return None, f"{module}.{attr} is not available: no attribute {attr}"
    return obj, None


def _available_backends(device: str, only: Sequence[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Names of the backends usable on ``device``, and why each other one is not.

    A backend counts if it is available and takes at least one of a few cases on ``device``
    (M = 1, 16, 1024; some kernels are for small or large M only); which cases it takes is
    asked again per benchmark.
    """
    names, skipped = [], {}
    dev_type = torch.device(device).type
    probes = [Case(M=m, N=256, K=256, recipe=W8A8_FP8, device=dev_type) for m in (1, 16, 1024)]
    for info in backends():
        if only is not None and info.name not in only:
            continue
        if not info.available:
            skipped[info.name] = f"unavailable: {info.reason}"
            continue
        reasons = []
        for case in probes:
            try:
                reason = decline_reason(get_backend(info.name), case)
            except Exception as exc:  # a broken supports() is reported, not fatal to the benchmark
                reason = f"supports() raised {exc!r}"
            if reason is None:
                names.append(info.name)
                break
            reasons.append((case.M, reason))
        else:
            distinct = sorted({r for _, r in reasons})
            skipped[info.name] = (f"takes no case on {dev_type}: {distinct[0]}" if len(distinct) == 1 else
                                  "takes none of " + "; ".join(f"M={m}: {r}" for m, r in reasons))
    if only is not None:
        for name in only:
            if name not in names and name not in skipped:
                skipped[name] = "not registered"
    return names, skipped


# --------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------

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


def _rotation(set_bytes: int, device: str) -> int:
    """How many input sets to rotate through so repeated calls do not just measure the GPU's L2."""
    if not _is_cuda(device):
        return 1
    return max(1, min(8, math.ceil((256 << 20) / max(set_bytes, 1))))


_PAST_DEADLINE = "skipped: the run's time budget was spent"


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def _resolve(backend: str | Backend) -> tuple[str, Backend]:
    """(name, instance) of a registered backend name or of a Backend instance (registered or not)."""
    if isinstance(backend, Backend):
        return backend.name, backend
    return backend, get_backend(backend)


def _cycler(items: Sequence[Any]) -> Callable[[], Any]:
    state = {"i": 0}

    def nxt():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        return item

    return nxt


def bench_quantization(device: str = "cpu", backend_names: Sequence[str | Backend] = ("reference",), *,
                       act_shape: tuple[int, int] = (1024, 4096), weight_shape: tuple[int, int] = (4096, 4096),
                       copy_gbps: float | None = None, repeat: int = 5, budget_s: float = 2.0,
                       deadline: float | None = None, log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """GB/s of every backend's ``quantize`` for each entry of ``QUANT_SCHEMES``.

    Each row holds ``gbps`` (``quant_bytes`` / median seconds) and, when ``copy_gbps`` is given,
    ``frac_of_copy``. A backend that does not implement a scheme gets a row with ``skipped``, as
    does every measurement after ``deadline`` (a ``time.perf_counter()`` value) has passed.

    Examples
    --------
    >>> from fp8ref.bench import bench_quantization
    >>> rows = bench_quantization("cpu", ["reference"], act_shape=(2, 128), weight_shape=(128, 128),
    ...                           copy_gbps=10.0, repeat=1, budget_s=0.05)
    >>> [(r["quant"], r["bytes"]) for r in rows[:2]]
    [('per-token', 776), ('per-group128', 776)]
    """
    rows = []
    for bname, backend in map(_resolve, backend_names):
        for qname, role, scheme in QUANT_SCHEMES:
            r, c = act_shape if role == "activation" else weight_shape
            row: dict[str, Any] = {"backend": bname, "quant": qname, "role": role, "scheme": scheme.short_str(),
                                   "shape": [r, c], "dtype": "bfloat16"}
            nbytes = quant_bytes(r, c, torch.bfloat16, scheme)
            if _past(deadline):
                row["skipped"] = _PAST_DEADLINE
                rows.append(row)
                continue
            sets = [torch.randn(r, c, device=device, dtype=torch.bfloat16)
                    for _ in range(_rotation(r * c * 2, device))]
            nxt = _cycler(sets)
            try:
                backend.quantize(sets[0], scheme)
            except Exception as exc:  # NotImplementedError or a declined scheme: say which
                row["skipped"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                log(f"  quantize {bname:12} {qname:13} skipped: {row['skipped']}")
                continue
            t = timeit(lambda nxt=nxt, scheme=scheme, backend=backend: backend.quantize(nxt(), scheme), device=device,
                       repeat=repeat, budget_s=budget_s)
            row.update(bytes=nbytes, seconds=t.median_s, gbps=nbytes / t.median_s / 1e9, timing=t.as_dict())
            if copy_gbps:
                row["frac_of_copy"] = row["gbps"] / copy_gbps
            rows.append(row)
            log(f"  quantize {bname:12} {qname:13} {row['gbps']:8.2f} GB/s")
    return rows


# --------------------------------------------------------------------------------------------
# linear per backend and auto
# --------------------------------------------------------------------------------------------

def _linear_api() -> tuple[Callable | None, str | None]:
    # fp8ref.linear is both a module and, once the selector lands, a function: take the
    # function from the module so the package attribute's shadowing does not matter.
    return peer_api("fp8ref.api", "linear")


def _auto_callable(xsets: Sequence[torch.Tensor], wsets: Sequence[torch.Tensor], qweights: Sequence[quant.Quantized],
                   pair: Callable[[], tuple[torch.Tensor, int]], recipe: Recipe
                   ) -> tuple[Callable[[], Any] | None, str]:
    """A no-argument call of ``fp8ref.linear(..., backend="auto")`` over the rotated inputs, and
    how the weight is passed.

    The pre-quantized weight is passed when ``linear`` takes one (as a server holds it);
    otherwise the float weight. ``linear`` caches each weight's prepared form on first use, so
    every weight of the rotation is used once here, before any timing.
    """
    linear, reason = _linear_api()
    if linear is None:
        return None, reason or "fp8ref.linear.linear is not available"
    for weights, how in ((qweights, "pre-quantized weight"), (wsets, "float weight (cached by fp8ref.linear)")):
        try:
            for i in range(max(len(xsets), len(weights))):
                linear(xsets[i % len(xsets)], weights[i % len(weights)], None, recipe=recipe, backend="auto")
        except (TypeError, ValueError):
            continue

        def call(weights=weights):
            x, wi = pair()
            return linear(x, weights[wi], None, recipe=recipe, backend="auto")

        return call, how
    return None, "fp8ref.linear(..., backend='auto') raised on both a quantized and a float weight"


def _selected_backend(x: torch.Tensor, weight: Any, recipe: Recipe) -> str | None:
    """The backend ``fp8ref.linear(x, weight, recipe=recipe)`` dispatches to under "auto".

    Asked through ``fp8ref.linear.explain``, which builds the very case ``linear`` does, so the
    answer comes from the selector's cache rather than from a new probe.
    """
    explain, _ = peer_api("fp8ref.api", "explain")
    if explain is None:
        return None
    try:
        chosen = getattr(explain(x, weight, recipe=recipe), "chosen", None)
    except Exception:  # a selector that cannot answer here just leaves the name out
        return None
    return chosen if isinstance(chosen, str) else None


def _default_precision() -> str:
    """The precision class ``fp8ref.linear(backend="auto")`` requires by default."""
    p, _ = peer_api("fp8ref.select", "DEFAULT_PRECISION")
    return p if isinstance(p, str) else "standard"


def _admitted(backend: Backend, precision: str) -> bool:
    """Whether ``auto`` at ``precision`` may pick ``backend`` (its precision class is admitted)."""
    return PrecisionClass(precision).admits(backend.precision)


def bench_linear(device: str = "cpu", backend_names: Sequence[str | Backend] = ("reference",), *,
                 shapes: Sequence[tuple[int, int]] = LLAMA3_8B_SHAPES, m_values: Sequence[int] = M_VALUES,
                 recipe: Recipe | str = W8A8_FP8, peak_gflops: float | None = None, include_auto: bool = True,
                 gemm_only: bool = False, repeat: int = 5, budget_s: float = 2.0, max_call_s: float = 2.0,
                 deadline: float | None = None, log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """``linear`` of each backend and of ``auto`` against bf16 ``F.linear``, one row per (K, N, M).

    A backend's ``linear`` is timed as a server runs it: the weight is quantized and passed
    through ``prepare_weight`` once, outside the timing; each call quantizes the activations
    (``backend.quantize``) and runs ``backend.scaled_mm`` to a bf16 output. With ``gemm_only``
    the FP8 GEMM alone (activations already quantized) is timed too.

    Each row has ``bf16_s`` (median seconds of ``F.linear`` on bf16), ``bf16_frac_of_peak`` and,
    per backend, ``seconds``, ``speedup_vs_bf16`` (= bf16_s / seconds: > 1 is faster than bf16)
    and ``frac_of_peak`` (achieved FLOP/s over ``peak_gflops``). A backend whose call took longer
    than ``max_call_s`` is not run at larger M for that shape (the row says so): times only grow
    with M. Past ``deadline`` (a ``time.perf_counter()`` value) every remaining entry is skipped.

    Examples
    --------
    >>> from fp8ref.bench import bench_linear
    >>> (row,) = bench_linear("cpu", ["reference"], shapes=[(64, 32)], m_values=[2], include_auto=False,
    ...                       repeat=1, budget_s=0.05)
    >>> e = row["backends"]["reference"]
    >>> abs(e["speedup_vs_bf16"] - row["bf16_s"] / e["seconds"]) < 1e-12
    True
    """
    recipe = get_recipe(recipe)
    dev_type = torch.device(device).type
    auto_precision = _default_precision()
    resolved = [_resolve(b) for b in backend_names]
    rows = []
    for K, N in shapes:
        too_slow: dict[str, str] = {}
        wset_bytes = N * K * 2
        wsets = [(torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5)
                 for _ in range(_rotation(wset_bytes, device))]
        prepared: dict[str, list[Any]] = {}
        qweights = [quant.quantize(w, recipe.weight) for w in wsets] if include_auto else []
        for M in sorted(m_values):  # ascending: a backend too slow at one M is skipped at larger ones
            flops = 2 * M * N * K
            case = Case(M=M, N=N, K=K, recipe=recipe, device=dev_type)
            xsets = [torch.randn(M, K, device=device, dtype=torch.bfloat16)
                     for _ in range(_rotation(M * K * 2 + wset_bytes, device))]
            n_sets = max(len(xsets), len(wsets))
            pair = _cycler([(xsets[i % len(xsets)], i % len(wsets)) for i in range(n_sets)])

            def bf16_call(pair=pair, wsets=wsets):
                x, wi = pair()
                return F.linear(x, wsets[wi])

            tb = timeit(bf16_call, device=device, repeat=repeat, budget_s=budget_s)
            row: dict[str, Any] = {"K": K, "N": N, "M": M, "recipe": recipe.name, "flops": flops,
                                   "bf16_s": tb.median_s, "bf16_gflops": flops / tb.median_s / 1e9,
                                   "backends": {}}
            if peak_gflops:
                row["bf16_frac_of_peak"] = row["bf16_gflops"] / peak_gflops
            for bname, backend in resolved:
                entry: dict[str, Any] = {}
                row["backends"][bname] = entry
                if bname in too_slow:
                    entry["skipped"] = too_slow[bname]
                    continue
                if _past(deadline):
                    entry["skipped"] = _PAST_DEADLINE
                    continue
                reason = decline_reason(backend, case)
                if reason is not None:
                    entry["skipped"] = f"does not support {case.short_str()}: {reason}"
                    continue
                try:
                    if bname not in prepared:
                        prepared[bname] = [backend.prepare_weight(backend.quantize(w, recipe.weight))
                                           for w in wsets]
                    pws = prepared[bname]

                    def call(pair=pair, backend=backend, pws=pws):
                        x, wi = pair()
                        return backend.linear(x, pws[wi], None, torch.bfloat16, recipe.activation)

                    t = timeit(call, device=device, repeat=repeat, budget_s=budget_s)
                    entry.update(seconds=t.median_s, speedup_vs_bf16=tb.median_s / t.median_s,
                                 precision=backend.precision.value, timing=t.as_dict())
                    if peak_gflops:
                        entry["frac_of_peak"] = flops / t.median_s / 1e9 / peak_gflops
                    if gemm_only:
                        qx = [backend.quantize(x, recipe.activation) for x in xsets]
                        gpair = _cycler([(qx[i % len(qx)], i % len(pws)) for i in range(n_sets)])

                        def gcall(gpair=gpair, backend=backend, pws=pws):
                            a, wi = gpair()
                            return backend.scaled_mm(a, pws[wi], None, torch.bfloat16)

                        tg = timeit(gcall, device=device, repeat=repeat, budget_s=budget_s)
                        entry.update(gemm_seconds=tg.median_s, gemm_speedup_vs_bf16=tb.median_s / tg.median_s)
                except Exception as exc:  # a backend failing here is a finding, reported in the row
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                    log(f"  linear {bname:12} K={K} N={N} M={M}: error {entry['error']}")
                    continue
                if t.median_s > max_call_s:
                    too_slow[bname] = (f"skipped: M={M} already took {t.median_s:.2f} s per call "
                                       f"(> max_call_s={max_call_s:g} s) at K={K} N={N}")
            if include_auto:
                entry = {}
                row["backends"]["auto"] = entry
                if "auto" in too_slow:
                    entry["skipped"] = too_slow["auto"]
                elif _past(deadline):
                    entry["skipped"] = _PAST_DEADLINE
                else:
                    t0 = time.perf_counter()
                    try:
                        fn, how = _auto_callable(xsets, wsets, qweights, pair, recipe)
                        warm_up = time.perf_counter() - t0
                        t = None if fn is None else timeit(fn, device=device, repeat=repeat, budget_s=budget_s)
                    except Exception as exc:  # e.g. no compliant backend: a finding, reported in the row
                        fn, t, how = None, None, f"error: {type(exc).__name__}: {exc}"
                    if t is None:
                        entry["error" if how.startswith("error") else "skipped"] = how
                    else:
                        # warm_up_s: the first call of every weight in the rotation, the selection included
                        entry.update(seconds=t.median_s, speedup_vs_bf16=tb.median_s / t.median_s,
                                     weight=how, precision=auto_precision, timing=t.as_dict(), warm_up_s=warm_up)
                        chosen = _selected_backend(xsets[0], qweights[0], recipe)
                        if chosen:
                            entry["selected"] = chosen
                        if peak_gflops:
                            entry["frac_of_peak"] = flops / t.median_s / 1e9 / peak_gflops
                        if t.median_s > max_call_s:
                            too_slow["auto"] = (f"skipped: M={M} already took {t.median_s:.2f} s per call "
                                                f"(> max_call_s={max_call_s:g} s) at K={K} N={N}")
            _fastest(row, [n for n, b in resolved if _admitted(b, auto_precision)])
            rows.append(row)
            log(f"  linear K={K:5} N={N:5} M={M:4}  bf16 {tb.median_s * 1e3:8.3f} ms  "
                + "  ".join(f"{b} x{e['speedup_vs_bf16']:.2f}" for b, e in row["backends"].items()
                            if "speedup_vs_bf16" in e))
    _release_weights()
    return rows


def _fastest(row: dict, compliant: Sequence[str] | None = None) -> None:
    """Annotate ``row`` with its fastest backend (optionally among ``compliant`` ones, e.g. those
    whose precision class ``auto`` admits) and auto's ratio to it."""
    times = {b: e["seconds"] for b, e in row["backends"].items()
             if b != "auto" and "seconds" in e and (compliant is None or b in compliant)}
    if not times:
        return
    best = min(times, key=times.get)
    row["fastest"] = best
    auto = row["backends"].get("auto", {})
    if "seconds" in auto:
        # auto's time over the fastest backend's: 1.05 means auto is 5 % slower.
        row["auto_over_fastest"] = auto["seconds"] / times[best]


# --------------------------------------------------------------------------------------------
# The reference itself
# --------------------------------------------------------------------------------------------

def bench_reference(device: str = "cpu", *, M: int = 128, K: int = 4096, N: int = 4096,
                    quant_shape: tuple[int, int] = (4096, 4096), repeat: int = 3, budget_s: float = 6.0,
                    log: Callable[[str], None] = lambda s: None) -> dict:
    """The spec's own speed: exact ``scaled_mm`` against fp32 ``F.linear``, ``quantize`` in GB/s.

    ``scaled_mm_over_fp32_linear`` is the reference GEMM's time over fp32 ``F.linear`` on the
    same [M, K] x [N, K] problem, both in this run (the spec's target is <= 3). The reference
    quantizer is timed on a bf16 ``quant_shape`` tensor with the default per-row scheme.

    Examples
    --------
    >>> from fp8ref.bench import bench_reference
    >>> r = bench_reference(M=4, K=64, N=32, quant_shape=(64, 64), repeat=1)
    >>> sorted(r)[:2]
    ['fp32_linear_s', 'quantize']
    """
    from .spec.gemm import scaled_mm

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=g)
    w = torch.randn(N, K, device=device, generator=g) / K**0.5
    qa, qb = quant.quantize(x, W8A8_FP8.activation), quant.quantize(w, W8A8_FP8.weight)
    t_ref = timeit(lambda: scaled_mm(qa, qb), device=device, repeat=repeat, budget_s=budget_s)
    t_f32 = timeit(lambda: F.linear(x, w), device=device, repeat=repeat, budget_s=budget_s)
    xq = torch.randn(*quant_shape, device=device, generator=g).to(torch.bfloat16)
    scheme = QuantScheme()
    t_q = timeit(lambda: quant.quantize(xq, scheme), device=device, repeat=repeat, budget_s=budget_s)
    nbytes = quant_bytes(*quant_shape, torch.bfloat16, scheme)
    out = {
        "scaled_mm": {"M": M, "K": K, "N": N, "seconds": t_ref.median_s, "timing": t_ref.as_dict()},
        "fp32_linear_s": t_f32.median_s,
        "scaled_mm_over_fp32_linear": t_ref.median_s / t_f32.median_s,
        "target_scaled_mm_over_fp32_linear": 3.0,
        "quantize": {"shape": list(quant_shape), "dtype": "bfloat16", "scheme": scheme.short_str(),
                     "bytes": nbytes, "seconds": t_q.median_s, "gbps": nbytes / t_q.median_s / 1e9,
                     "timing": t_q.as_dict()},
    }
    log(f"  reference scaled_mm M={M} K={K} N={N}: {t_ref.median_s * 1e3:.1f} ms = "
        f"{out['scaled_mm_over_fp32_linear']:.2f} x fp32 F.linear; quantize {out['quantize']['gbps']:.3f} GB/s")
    return out


# --------------------------------------------------------------------------------------------
# Selector and conformance
# --------------------------------------------------------------------------------------------

def _clear_selector_memory() -> bool:
    """Empty the selector's in-memory decisions (never its on-disk cache); False if it cannot."""
    fn, _ = peer_api("fp8ref.select", "clear_cache")
    if not callable(fn):
        return False
    fn(memory=True, disk=False)
    return True


def _release_weights() -> None:
    """Drop ``fp8ref.linear``'s cached quantized/prepared weights once a benchmark is done with them."""
    fn, _ = peer_api("fp8ref.api", "clear_weight_cache")
    if callable(fn):
        fn()


def bench_selector(device: str = "cpu", *, M: int = 16, K: int = 4096, N: int = 4096,
                   overhead_shape: tuple[int, int, int] = (1, 256, 256), recipe: Recipe | str = W8A8_FP8,
                   repeat: int = 20, budget_s: float = 3.0) -> dict:
    """Dispatch overhead of ``fp8ref.linear(backend="auto")`` and the time of a first selection.

    - ``first_selection_s`` (at ``M, K, N``): the first ``auto`` call with both selector caches
      empty (memory cleared, ``FP8REF_CACHE_DIR`` pointed at a fresh temporary directory for the
      measurement, so the probe and the timing run), minus a cached call.
    - ``disk_lookup_s``: the same after clearing the memory cache only (the decision is read
      back from the on-disk cache), minus a cached call.
    - ``dispatch_overhead_s`` (at ``overhead_shape`` = (M, K, N), small so that microseconds
      show): the fastest ``linear(..., backend="auto")`` sample minus the fastest
      ``linear(..., backend=<the backend auto chose>)`` sample on the same inputs, both cached:
      what choosing costs per call. Minima, because preemption on a shared machine only ever
      adds time; the medians are kept too.

    The user's own on-disk cache is never read or written here.
    """
    import tempfile

    recipe = get_recipe(recipe)
    linear, reason = _linear_api()
    if linear is None:
        return {"skipped": reason}
    env_name, _ = peer_api("fp8ref.select", "ENV_CACHE_DIR")
    env_name = env_name if isinstance(env_name, str) else "FP8REF_CACHE_DIR"
    sync = _synchronizer(device)

    def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, quant.Quantized]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        return x, quant.quantize(w, recipe.weight)

    def first_call(x, weight) -> float:
        sync()
        t0 = time.perf_counter()
        linear(x, weight, None, recipe=recipe, backend="auto")
        sync()
        return time.perf_counter() - t0

    old = os.environ.get(env_name)
    out: dict[str, Any] = {"M": M, "K": K, "N": N, "recipe": recipe.name}
    try:
        with tempfile.TemporaryDirectory(prefix="fp8ref-bench-") as tmp:
            os.environ[env_name] = tmp
            if not _clear_selector_memory():
                return {"skipped": "fp8ref.select.clear_cache is not available: cannot measure a first selection"}
            x, weight = operands(M, K, N)
            cold = first_call(x, weight)
            _clear_selector_memory()
            disk = first_call(x, weight)
            t_big = timeit(lambda: linear(x, weight, None, recipe=recipe, backend="auto"), device=device,
                           repeat=5, budget_s=budget_s)
            out.update(first_call_s=cold, first_selection_s=max(cold - t_big.median_s, 0.0),
                       disk_lookup_s=max(disk - t_big.median_s, 0.0), cached_call_s=t_big.median_s,
                       selected_at_first_shape=_selected_backend(x, weight, recipe))
            m2, k2, n2 = overhead_shape
            x2, weight2 = operands(m2, k2, n2)
            t_auto = timeit(lambda: linear(x2, weight2, None, recipe=recipe, backend="auto"), device=device,
                            repeat=repeat, budget_s=budget_s)
            chosen = _selected_backend(x2, weight2, recipe)
            out.update(overhead_shape=list(overhead_shape), auto_s=t_auto.median_s, auto_min_s=t_auto.min_s)
            if chosen:
                t_named = timeit(lambda: linear(x2, weight2, None, recipe=recipe, backend=chosen), device=device,
                                 repeat=repeat, budget_s=budget_s)
                out.update(selected=chosen, named_s=t_named.median_s, named_min_s=t_named.min_s,
                           dispatch_overhead_s=t_auto.min_s - t_named.min_s)
            else:
                out["dispatch_overhead_s"] = None
                out["note"] = "the selector did not name its choice (fp8ref.linear.explain missing or failing)"
            # Decisions made against the temporary cache must not outlive it in memory.
            _clear_selector_memory()
    finally:
        if old is None:
            os.environ.pop(env_name, None)
        else:
            os.environ[env_name] = old
        _release_weights()
    return out


def _count_examples(report: Any) -> int | None:
    """Examples a conformance report ran: the sum of its results' ``examples`` where they say."""
    results = getattr(report, "results", None)
    if isinstance(results, (list, tuple)) and results and all(
            isinstance(getattr(r, "examples", None), int) for r in results):
        return sum(r.examples for r in results)
    for attr in ("n_examples", "examples", "n_cases", "total", "n"):
        v = getattr(report, attr, None) if not isinstance(report, dict) else report.get(attr)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, (list, tuple)):
            return len(v)
    for attr in ("results", "cases", "rows"):
        v = getattr(report, attr, None) if not isinstance(report, dict) else report.get(attr)
        if isinstance(v, (list, tuple)):
            return len(v)
    if isinstance(report, (list, tuple)):
        return len(report)
    return None


def _report_passed(report: Any) -> bool | None:
    for attr in ("passed", "ok", "compliant"):
        v = getattr(report, attr, None) if not isinstance(report, dict) else report.get(attr)
        if isinstance(v, bool):
            return v
        if callable(v):
            try:
                r = v()
            except TypeError:
                continue
            if isinstance(r, bool):
                return r
    return None


def bench_conformance(backend_names: Sequence[str] = ("reference",), *, profile: str = "dev",
                      max_examples: int | None = None, log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Examples per second of ``fp8ref.conformance.check(backend, profile)`` for each backend."""
    check, reason = peer_api("fp8ref.conformance", "check")
    if check is None:
        return [{"backend": b, "skipped": reason} for b in backend_names]
    rows = []
    for bname in backend_names:
        t0 = time.perf_counter()
        try:
            report = (check(bname, profile, seed=0) if max_examples is None
                      else check(bname, profile, seed=0, max_examples=max_examples))
        except Exception as exc:  # reported per backend, the others still run
            rows.append({"backend": bname, "profile": profile, "error": f"{type(exc).__name__}: {exc}"})
            continue
        dt = time.perf_counter() - t0
        n = _count_examples(report)
        row = {"backend": bname, "profile": profile, "seconds": dt, "examples": n,
               "examples_per_s": (n / dt) if n else None, "passed": _report_passed(report)}
        rows.append(row)
        log(f"  conformance {bname:12} {profile}: {n} examples in {dt:.2f} s")
    return rows


# --------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------

def _meta(device: str, quick: bool) -> dict:
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "quick": quick,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if hasattr(os, "getloadavg"):
        meta["loadavg_start"] = list(os.getloadavg())
    if _is_cuda(device):
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
    return meta


def run(device: str = "cpu", *, quick: bool = False, backends_only: Sequence[str] | None = None,
        shapes: Sequence[tuple[int, int]] | None = None, m_values: Sequence[int] | None = None,
        sections: Sequence[str] = ("ceilings", "quant", "linear", "reference", "selector", "conformance"),
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
    unknown = set(sections) - {"ceilings", "quant", "linear", "reference", "selector", "conformance"}
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
    names, skipped = _available_backends(device, backends_only)
    res: dict[str, Any] = {"meta": _meta(device, quick), "backends": names, "backends_skipped": skipped,
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
                                          repeat=repeat, budget_s=0.2 if quick else min(budget, 1.0), deadline=deadline,
                                          log=log)
    if "linear" in sections:
        log("linear")
        res["linear"] = bench_linear(device, names, shapes=shapes, m_values=m_values, peak_gflops=peak,
                                     gemm_only=gemm_only, repeat=repeat, budget_s=budget,
                                     max_call_s=max_call_s, deadline=deadline, log=log)
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
    return res


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_report(res: dict) -> str:
    """The tables ``fp8ref bench`` prints: every figure as a ratio to its ceiling or baseline.

    Examples
    --------
    >>> from fp8ref.bench import format_report
    >>> print(format_report({"meta": {"device": "cpu"}, "copy": {"gbps": 10.0},
    ...                      "bf16_peak": {"gflops": 100.0, "n": 2048}}).splitlines()[-1])
    ceilings: memory copy 10.00 GB/s (read + write); bf16 GEMM peak 100.0 GFLOP/s (n=2048)
    """
    out = []
    meta = res.get("meta", {})
    out.append(f"fp8ref bench on {meta.get('gpu', meta.get('device'))} (torch {meta.get('torch')}, "
               f"{meta.get('cpu_count')} CPUs, {meta.get('torch_threads')} threads, {meta.get('date_utc')}"
               f"{', quick' if meta.get('quick') else ''})")
    if "loadavg_start" in meta:
        out.append(f"load average at start {meta['loadavg_start'][0]:.2f}"
                   + (f", at end {meta['loadavg_end'][0]:.2f}" if "loadavg_end" in meta else ""))
    if res.get("backends_skipped"):
        out.append("backends not run: " + "; ".join(f"{k} ({v})" for k, v in res["backends_skipped"].items()))
    if "copy" in res:
        out.append(f"\nceilings: memory copy {res['copy']['gbps']:.2f} GB/s (read + write); "
                   f"bf16 GEMM peak {res['bf16_peak']['gflops']:.1f} GFLOP/s (n={res['bf16_peak']['n']})")
    if res.get("quant"):
        out.append("\nquantization (GB/s = input read + codes and scales written; % of memory copy)")
        out.append(f"  {'backend':12} {'quant':13} {'shape':>11} {'GB/s':>9} {'% copy':>7}")
        for r in res["quant"]:
            shape = "x".join(map(str, r["shape"]))
            if "gbps" in r:
                frac = r.get("frac_of_copy")
                out.append(f"  {r['backend']:12} {r['quant']:13} {shape:>11} {r['gbps']:9.3f} "
                           f"{_fmt(None if frac is None else 100 * frac, '6.1f'):>7}")
            else:
                out.append(f"  {r['backend']:12} {r['quant']:13} {shape:>11}  skipped: {r['skipped'][:60]}")
    if res.get("linear"):
        cols = []
        for r in res["linear"]:
            for b in r["backends"]:
                if b not in cols:
                    cols.append(b)
        out.append("\nlinear (W8A8 per-channel/per-token, bf16 out): speed-up over bf16 F.linear "
                   "(> 1 = faster) / % of bf16 GEMM peak")
        out.append(f"  {'K':>5} {'N':>5} {'M':>4} {'bf16 ms':>9} {'bf16 %pk':>8} "
                   + " ".join(f"{c:>15}" for c in cols) + "  auto/fastest")
        for r in res["linear"]:
            cells = []
            for c in cols:
                e = r["backends"].get(c, {})
                if "speedup_vs_bf16" in e:
                    pk = e.get("frac_of_peak")
                    cells.append(f"{e['speedup_vs_bf16']:7.3f}/{_fmt(None if pk is None else 100 * pk, '5.1f'):>5}%"
                                 .rjust(15))
                else:
                    cells.append(("err" if "error" in e else "skip").rjust(15))
            bpk = r.get("bf16_frac_of_peak")
            out.append(f"  {r['K']:5} {r['N']:5} {r['M']:4} {r['bf16_s'] * 1e3:9.3f} "
                       f"{_fmt(None if bpk is None else 100 * bpk, '7.1f'):>8} " + " ".join(cells)
                       + f"  {_fmt(r.get('auto_over_fastest'), '.3f')} ({r.get('fastest', '-')})")
        gem = [(r, b, e) for r in res["linear"] for b, e in r["backends"].items() if "gemm_speedup_vs_bf16" in e]
        if gem:
            out.append("  FP8 GEMM alone (activations pre-quantized), speed-up over bf16 F.linear:")
            for r, b, e in gem:
                out.append(f"    K={r['K']} N={r['N']} M={r['M']} {b}: {e['gemm_speedup_vs_bf16']:.3f}")
    if "reference" in res:
        ref = res["reference"]
        sm = ref["scaled_mm"]
        out.append(f"\nreference: exact scaled_mm M={sm['M']} K={sm['K']} N={sm['N']} takes "
                   f"{ref['scaled_mm_over_fp32_linear']:.2f} x fp32 F.linear (target <= "
                   f"{ref['target_scaled_mm_over_fp32_linear']:g}); quantize {ref['quantize']['shape'][0]}x"
                   f"{ref['quantize']['shape'][1]} bf16: {ref['quantize']['gbps']:.3f} GB/s"
                   + (f" = {100 * ref['quantize']['gbps'] / res['copy']['gbps']:.1f} % of copy"
                      if "copy" in res else ""))
    if "selector" in res:
        s = res["selector"]
        if "skipped" in s:
            out.append(f"\nselector: skipped ({s['skipped']})")
        else:
            ov = s.get("dispatch_overhead_s")
            om, ok_, on = s.get("overhead_shape", (s["M"], s["K"], s["N"]))
            out.append(f"\nselector: first selection (probe + timing) at M={s['M']} K={s['K']} N={s['N']}: "
                       f"{s['first_selection_s'] * 1e3:.1f} ms; from the disk cache {s['disk_lookup_s'] * 1e3:.2f} ms"
                       + (f" (picks {s['selected_at_first_shape']})" if s.get("selected_at_first_shape") else ""))
            out.append(f"  dispatch overhead at M={om} K={ok_} N={on}: "
                       f"{_fmt(None if ov is None else ov * 1e6, '.1f')} us per call "
                       f"({_fmt(None if ov is None else 100 * ov / s['auto_min_s'], '.1f')} % of the auto call"
                       + ("; below the timing noise" if ov is not None and ov < 0 else "") + ")"
                       + (f"; picks {s['selected']}" if s.get("selected") else ""))
    if res.get("conformance"):
        out.append("\nconformance throughput:")
        for c in res["conformance"]:
            if "skipped" in c or "error" in c:
                out.append(f"  {c['backend']:12} {c.get('skipped') or c.get('error')}")
            else:
                out.append(f"  {c['backend']:12} {c['profile']}: {_fmt(c['examples_per_s'], '.1f')} examples/s "
                           f"({c['examples']} in {c['seconds']:.2f} s, passed={c['passed']})")
    if "elapsed_s" in meta:
        out.append(f"\nelapsed {meta['elapsed_s']:.1f} s")
    return "\n".join(out)
