"""One linear computed the FP8 way for one audited backend name, or for ``"auto"`` (``fp8ref.linear``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..api import linear, quantize_weight
from ..registry import Backend, Case, decline_reason, get_backend
from ..select import resolve
from ..spec.quant import Quantized
from ..spec.schemes import Recipe

__all__ = ["Runner"]


class Runner:
    """Computes one linear the FP8 way for one requested backend name (or ``"auto"``)."""

    def __init__(self, spec: str, recipe: Recipe, precision: str,
                 candidates: tuple[str, ...] | None = None) -> None:
        self.spec, self.recipe, self.precision, self.candidates = spec, recipe, precision, candidates
        self.note = ""
        self.seconds = 0.0
        self._weights: dict[str, tuple[Quantized, Any]] = {}
        self._last_x: tuple[object, str, Quantized] | None = None
        self.backend: Backend | None = None
        if spec != "auto":
            self.backend = get_backend(spec)
            reason = self.backend.available()
            if reason is not None:
                raise ValueError(f"backend {spec!r} is not available here: {reason}")

    def _case(self, x2: torch.Tensor, w: torch.Tensor, bias, od: torch.dtype) -> Case:
        return Case(M=x2.shape[0], N=w.shape[0], K=w.shape[1], recipe=self.recipe, x_dtype=x2.dtype, out_dtype=od,
                    device=str(x2.device), has_bias=bias is not None)

    def _quantize_x(self, b: Backend, x2: torch.Tensor, src: object) -> Quantized:
        # q_proj/k_proj/v_proj (and gate/up) receive the very same input tensor: quantize once.
        if self._last_x is not None and self._last_x[0] is src and self._last_x[1] == b.name:
            return self._last_x[2]
        qx = b.quantize(x2, self.recipe.activation)
        self._last_x = (src, b.name, qx)
        return qx

    def __call__(self, key: str, x2: torch.Tensor, w: torch.Tensor, bias, od: torch.dtype, src: object = None
                 ) -> tuple[torch.Tensor, Callable[[], Quantized], Quantized, Backend]:
        """(y, a function giving the quantized activations, quantized weight, backend used).

        Under "auto" the activations are quantized inside ``fp8ref.linear``; the statistics
        need them too, so they are quantized again with the chosen backend, but only when asked.
        """
        t0 = time.perf_counter()
        try:
            if self.backend is None:
                b, _ = resolve(self._case(x2, w, bias, od), "auto", self.precision, candidates=self.candidates)
                y = linear(x2, w, bias, recipe=self.recipe, backend="auto", precision=self.precision,
                           out_dtype=od, candidates=self.candidates)
                if key not in self._weights:
                    # fp8ref.linear quantizes weights with the reference quantizer, so the
                    # statistics and the bound use that same Quantized.
                    self._weights[key] = (quantize_weight(w, self.recipe), None)
                qw = self._weights[key][0]
                return y, lambda: self._quantize_x(b, x2, x2 if src is None else src), qw, b
            b = self.backend
            reason = decline_reason(b, self._case(x2, w, bias, od))
            if reason is not None:
                raise ValueError(f"backend {b.name!r} does not take layer {key!r} "
                                 f"(M={x2.shape[0]}, N={w.shape[0]}, K={w.shape[1]}, {x2.dtype}): {reason}")
            if key not in self._weights:
                qw = b.quantize(w, self.recipe.weight)
                self._weights[key] = (qw, b.prepare_weight(qw))
            qw, prepared = self._weights[key]
            qx = self._quantize_x(b, x2, x2 if src is None else src)
            return b.scaled_mm(qx, prepared, bias, od), lambda: qx, qw, b
        finally:
            self.seconds += time.perf_counter() - t0
