"""The selector's costs: the dispatch overhead of ``fp8ref.linear(backend="auto")`` and the time of
a first selection (probe and timing), measured against a throw-away cache directory."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..api import clear_weight_cache, linear
from ..select import clear_cache
from ..spec import quant
from ..spec.schemes import W8A8_FP8, Recipe, get_recipe
from .linear import selected_backend
from .timing import synchronizer, throwaway_selector_cache, timeit

__all__ = ["bench_selector"]


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
    recipe = get_recipe(recipe)
    sync = synchronizer(device)

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

    out: dict[str, Any] = {"M": M, "K": K, "N": N, "recipe": recipe.name}
    try:
        with throwaway_selector_cache():
            x, weight = operands(M, K, N)
            cold = first_call(x, weight)
            clear_cache(memory=True, disk=False)
            disk = first_call(x, weight)
            t_big = timeit(lambda: linear(x, weight, None, recipe=recipe, backend="auto"), device=device,
                           repeat=5, budget_s=budget_s)
            out.update(first_call_s=cold, first_selection_s=max(cold - t_big.median_s, 0.0),
                       disk_lookup_s=max(disk - t_big.median_s, 0.0), cached_call_s=t_big.median_s,
                       selected_at_first_shape=selected_backend(x, weight, recipe))
            m2, k2, n2 = overhead_shape
            x2, weight2 = operands(m2, k2, n2)
            t_auto = timeit(lambda: linear(x2, weight2, None, recipe=recipe, backend="auto"), device=device,
                            repeat=repeat, budget_s=budget_s)
            chosen = selected_backend(x2, weight2, recipe)
            out.update(overhead_shape=list(overhead_shape), auto_s=t_auto.median_s, auto_min_s=t_auto.min_s)
            if chosen:
                t_named = timeit(lambda: linear(x2, weight2, None, recipe=recipe, backend=chosen), device=device,
                                 repeat=repeat, budget_s=budget_s)
                out.update(selected=chosen, named_s=t_named.median_s, named_min_s=t_named.min_s,
                           dispatch_overhead_s=t_auto.min_s - t_named.min_s)
            else:
                out["dispatch_overhead_s"] = None
                out["note"] = "fp8ref.explain found no compliant backend at this shape"
    finally:
        clear_weight_cache()
    return out
