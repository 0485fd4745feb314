"""Which backends a benchmark runs: those available on the device that take at least one case."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..registry import Backend, Case, backends, decline_reason, get_backend
from ..spec.schemes import W8A8_FP8

__all__ = ["available_backends", "resolve_backend"]


def available_backends(device: str, only: Sequence[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Names of the backends usable on ``device``, and why each other one is not.

    A backend counts if it is available and takes at least one of a few cases on ``device``
    (M = 1, 16, 1024; some kernels are for small or large M only); which cases it takes is
    asked again per benchmark. A backend whose optional ``bench_skip_reason`` hint is set (the
    triton backend under Triton's CPU interpreter, where one quantization of the default
    [1024, 4096] activation ran for over ten minutes with no output) is left out with that reason
    unless ``only`` names it.
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
        hint = get_backend(info.name).bench_skip_reason
        if hint and (only is None or info.name not in only):
            skipped[info.name] = f"not timed: {hint} (name it with --backend to time it anyway)"
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


def resolve_backend(backend: str | Backend) -> tuple[str, Backend]:
    """(name, instance) of a registered backend name or of a Backend instance (registered or not)."""
    if isinstance(backend, Backend):
        return backend.name, backend
    return backend, get_backend(backend)
