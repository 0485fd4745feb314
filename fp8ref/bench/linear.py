"""``linear`` of every backend and of ``auto`` against bf16 ``F.linear``, at the Llama-3.1-8B layer shapes.

Each figure is a speed-up over bf16 ``F.linear`` timed in the same run, and a fraction of the
bf16 GEMM peak; ``auto`` (``fp8ref.linear``) is also compared with the fastest backend it may pick.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..api import clear_weight_cache, explain, linear
from ..registry import Backend, Case, decline_reason
from ..select import DEFAULT_PRECISION
from ..spec import quant
from ..spec.bounds import PrecisionClass
from ..spec.schemes import W8A8_FP8, Recipe, get_recipe
from .backends import resolve_backend
from .timing import PAST_DEADLINE, cycler, paired, past, rotation, throwaway_selector_cache, timeit

__all__ = ["LLAMA3_8B_SHAPES", "M_VALUES", "bench_linear", "selected_backend"]

#: (K, N) of the Llama-3.1-8B linear layers: attention out-proj (and q), MLP up/gate, MLP down,
#: fused QKV (4096 + 2 * 1024 for the 8 KV heads of 128).
LLAMA3_8B_SHAPES: tuple[tuple[int, int], ...] = ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144))
#: Tokens per forward pass: decode (1), small and medium batches, prefill (1024).
M_VALUES: tuple[int, ...] = (1, 16, 128, 1024)


def _auto_callable(xsets: Sequence[torch.Tensor], qweights: Sequence[quant.Quantized],
                   pair: Callable[[], tuple[torch.Tensor, int]], recipe: Recipe) -> Callable[[], Any]:
    """A no-argument call of ``fp8ref.linear(..., backend="auto")`` over the rotated inputs, with
    the pre-quantized weight (as a server holds it).

    ``linear`` selects a backend and prepares each weight on first use, so every weight of the
    rotation is used once here, before any timing.
    """
    for i in range(max(len(xsets), len(qweights))):
        linear(xsets[i % len(xsets)], qweights[i % len(qweights)], None, recipe=recipe, backend="auto")

    def call():
        x, wi = pair()
        return linear(x, qweights[wi], None, recipe=recipe, backend="auto")

    return call


def selected_backend(x: torch.Tensor, weight: Any, recipe: Recipe) -> str | None:
    """The backend ``fp8ref.linear(x, weight, recipe=recipe)`` dispatches to under "auto".

    Asked through ``fp8ref.explain``, which builds the very case ``linear`` does, so the
    answer comes from the selector's cache rather than from a new probe.
    """
    try:
        decision = explain(x, weight, recipe=recipe)
    except (RuntimeError, ValueError):  # no compliant backend here: the row says so elsewhere
        return None
    return decision.chosen


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
    per backend, ``seconds``, ``speedup_vs_bf16`` (> 1 is faster than bf16: the median over
    rounds of bf16 seconds / backend seconds, the two samples of a round back to back: see
    ``timing.paired``), ``speedup_unpaired`` (= bf16_s / seconds, the ratio of two medians taken
    apart, which carries the machine's drift between them) and ``frac_of_peak`` (achieved FLOP/s
    over ``peak_gflops``). ``fastest`` is the admitted backend with the best speed-up, and
    ``auto_over_fastest`` auto's time over the fastest backend's, both timed back to back on the same
    weight (see ``_auto_beside_the_fastest``; 1.05 = 5 % slower). A backend whose call took longer
    than ``max_call_s`` is not run at larger M for that shape (the row says so): times only grow
    with M. Past ``deadline`` (a ``time.perf_counter()`` value) every remaining entry is skipped.

    Examples
    --------
    >>> from fp8ref.bench import bench_linear
    >>> (row,) = bench_linear("cpu", ["reference"], shapes=[(64, 32)], m_values=[2], include_auto=False,
    ...                       repeat=1, budget_s=0.05)
    >>> e = row["backends"]["reference"]
    >>> abs(e["speedup_unpaired"] - row["bf16_s"] / e["seconds"]) < 1e-12, e["speedup_vs_bf16"] > 0
    (True, True)
    """
    recipe = get_recipe(recipe)
    dev_type = torch.device(device).type
    auto_precision = DEFAULT_PRECISION
    resolved = [resolve_backend(b) for b in backend_names]
    rows = []
    # auto decides anew in every run (this code, this machine), never from the user's cache
    with throwaway_selector_cache() if include_auto else contextlib.nullcontext():
        for K, N in shapes:
            too_slow: dict[str, str] = {}
            wset_bytes = N * K * 2
            wsets = [(torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5)
                     for _ in range(rotation(wset_bytes, device))]
            prepared: dict[str, list[Any]] = {}
            qweights = [quant.quantize(w, recipe.weight) for w in wsets] if include_auto else []
            for M in sorted(m_values):  # ascending: a backend too slow at one M is skipped at larger ones
                flops = 2 * M * N * K
                case = Case(M=M, N=N, K=K, recipe=recipe, device=dev_type)
                xsets = [torch.randn(M, K, device=device, dtype=torch.bfloat16)
                         for _ in range(rotation(M * K * 2 + wset_bytes, device))]
                n_sets = max(len(xsets), len(wsets))
                pair = cycler([(xsets[i % len(xsets)], i % len(wsets)) for i in range(n_sets)])

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
                    if past(deadline):
                        entry["skipped"] = PAST_DEADLINE
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

                        p = paired(bf16_call, call, device=device, repeat=repeat, budget_s=budget_s)
                        t = p.timing
                        entry.update(seconds=t.median_s, speedup_vs_bf16=p.ratio,
                                     speedup_unpaired=tb.median_s / t.median_s, bf16_paired_s=p.base.median_s,
                                     paired_rounds=p.rounds, precision=backend.precision.value, timing=t.as_dict())
                        if peak_gflops:
                            entry["frac_of_peak"] = flops / t.median_s / 1e9 / peak_gflops
                        if gemm_only:
                            qx = [backend.quantize(x, recipe.activation) for x in xsets]
                            gpair = cycler([(qx[i % len(qx)], i % len(pws)) for i in range(n_sets)])

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
                auto_fn = None
                if include_auto:
                    entry = {}
                    row["backends"]["auto"] = entry
                    if "auto" in too_slow:
                        entry["skipped"] = too_slow["auto"]
                    elif past(deadline):
                        entry["skipped"] = PAST_DEADLINE
                    else:
                        t0 = time.perf_counter()
                        try:
                            fn = auto_fn = _auto_callable(xsets, qweights, pair, recipe)
                            warm_up = time.perf_counter() - t0
                            p = paired(bf16_call, fn, device=device, repeat=repeat, budget_s=budget_s)
                            t = p.timing
                        except Exception as exc:  # e.g. no compliant backend: a finding, reported in the row
                            entry["error"] = f"{type(exc).__name__}: {exc}"
                        else:
                            # warm_up_s: the first call of every weight in the rotation, the selection included
                            entry.update(seconds=t.median_s, speedup_vs_bf16=p.ratio,
                                         speedup_unpaired=tb.median_s / t.median_s, bf16_paired_s=p.base.median_s,
                                         paired_rounds=p.rounds, weight="pre-quantized", precision=auto_precision,
                                         timing=t.as_dict(), warm_up_s=warm_up)
                            chosen = selected_backend(xsets[0], qweights[0], recipe)
                            if chosen:
                                entry["selected"] = chosen
                            if peak_gflops:
                                entry["frac_of_peak"] = flops / t.median_s / 1e9 / peak_gflops
                            if t.median_s > max_call_s:
                                too_slow["auto"] = (f"skipped: M={M} already took {t.median_s:.2f} s per call "
                                                    f"(> max_call_s={max_call_s:g} s) at K={K} N={N}")
                admitted = [n for n, b in resolved if _admitted(b, auto_precision)]
                _fastest(row, admitted)
                if auto_fn is not None and "speedup_vs_bf16" in row["backends"]["auto"] and not past(deadline):
                    _auto_beside_the_fastest(row, admitted, auto_fn, qweights, pair, recipe, device=device,
                                             repeat=repeat, budget_s=budget_s, log=log)
                rows.append(row)
                log(f"  linear K={K:5} N={N:5} M={M:4}  bf16 {tb.median_s * 1e3:8.3f} ms  "
                    + "  ".join(f"{b} x{e['speedup_vs_bf16']:.2f}" for b, e in row["backends"].items()
                                if "speedup_vs_bf16" in e))
    clear_weight_cache()  # drop fp8ref.linear's cached quantized/prepared weights
    return rows


#: How many of the fastest admitted backends (by their speed-up over bf16) ``auto`` is timed
#: beside, back to back, for ``auto_over_fastest``.
BESIDE_AUTO = 2


def _ranked(row: dict, compliant: Sequence[str] | None = None) -> list[str]:
    """The backends of ``row`` with a speed-up over bf16 (optionally only ``compliant`` ones, e.g.
    those whose precision class ``auto`` admits), fastest first."""
    speed = {b: e["speedup_vs_bf16"] for b, e in row["backends"].items()
             if b != "auto" and "speedup_vs_bf16" in e and (compliant is None or b in compliant)}
    return sorted(speed, key=speed.get, reverse=True)


def _fastest(row: dict, compliant: Sequence[str] | None = None) -> None:
    """Annotate ``row`` with its fastest backend (optionally among ``compliant`` ones) and auto's
    ratio to it through bf16: the two speed-ups' quotient, ``auto_over_fastest_via_bf16``, and
    ``auto_over_fastest`` until ``_auto_beside_the_fastest`` replaces it with a direct measurement."""
    ranked = _ranked(row, compliant)
    if not ranked:
        return
    best = ranked[0]
    row["fastest"] = best
    auto = row["backends"].get("auto", {})
    if "speedup_vs_bf16" in auto:
        # auto's time over the fastest backend's, each against the bf16 samples taken beside it:
        # 1.05 = 5 % slower. Only a drift that bf16 F.linear feels too cancels (see below).
        ratio = row["backends"][best]["speedup_vs_bf16"] / auto["speedup_vs_bf16"]
        row["auto_over_fastest_via_bf16"] = row["auto_over_fastest"] = ratio


def _auto_beside_the_fastest(row: dict, admitted: Sequence[str], auto_call: Callable[[], Any],
                             qweights: Sequence[quant.Quantized], pair: Callable[[], tuple[torch.Tensor, int]],
                             recipe: Recipe, *, device: str, repeat: int, budget_s: float,
                             log: Callable[[str], None]) -> None:
    """``auto`` timed back to back with each of the ``BESIDE_AUTO`` fastest admitted backends.

    Each backend is called as ``fp8ref.linear(..., backend=name)`` on the very quantized weights
    ``auto`` runs on, so both share the prepared copy that ``fp8ref.linear`` caches per weight and
    backend: what differs is the choice alone (and, for ``auto``, the selector's lookup). Two
    speed-ups over bf16 ``F.linear`` do not compare two FP8 backends well where those stream their
    weight from memory and ``F.linear`` does not reach the bandwidth: a drift of the bandwidth
    moves the backend's samples and not the bf16 ones beside them (docs/performance.md, "Figures
    behind the code": a backend's time per call moved by a third a minute apart while bf16
    ``F.linear``'s held), and every backend's row prepares a copy of its own.

    Sets ``row["auto_beside"]`` (name -> median over rounds of auto's time over that backend's),
    ``row["auto_over_fastest"]`` = its largest value: auto against whichever of them ran fastest
    beside it (1.05 = 5 % slower), and ``row["fastest_beside"]`` = that backend's name.
    """
    beside: dict[str, float] = {}
    for name in _ranked(row, admitted)[:BESIDE_AUTO]:
        def forced(name=name):
            x, wi = pair()
            return linear(x, qweights[wi], None, recipe=recipe, backend=name)

        try:
            beside[name] = paired(auto_call, forced, device=device, repeat=repeat, budget_s=budget_s).ratio
        except Exception as exc:  # the backend ran in its row: a failure here is a finding, reported
            row.setdefault("auto_beside_errors", {})[name] = f"{type(exc).__name__}: {exc}"
            log(f"  auto beside {name} K={row['K']} N={row['N']} M={row['M']}: error {exc}")
    if beside:
        row["auto_beside"] = beside
        row["fastest_beside"] = max(beside, key=beside.get)
        row["auto_over_fastest"] = beside[row["fastest_beside"]]
