"""Online FP8 quantization of a layer: ``Fp8Linear``.

``Fp8Linear`` stores the weight once as FP8 codes plus dequantization scales (buffers ``weight``
and ``weight_scale``, the compressed-tensors names), keeps the bias as it was, and runs
``fp8ref.linear`` in ``forward`` (backend "auto" by default: the fastest compliant backend).
``fp8ref.surgery.quantize_model`` swaps every ``nn.Linear`` of a model for one, in place.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .api import linear
from .ops import linear_op, recipe_key
from .registry import ENV_ALLOW, Backend, Case
from .select import ENV_BACKEND, ENV_CANDIDATES, generation, resolve
from .spec.checks import check_codes, check_dense, check_finite, check_linear_args, check_values
from .spec.fenv import flushing
from .spec.quant import Quantized, check_float_input, quantize
from .spec.schemes import W8A8_FP8, Recipe, get_recipe
from .weightcheck import ENV_WEIGHT_CHECK, MemorySample, tensor_version

__all__ = ["Fp8Linear"]


class Fp8Linear(nn.Module):
    """A linear layer whose weight is stored in FP8 and whose activations are quantized on the fly.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool
    recipe : Recipe or str
        Default ``W8A8_FP8`` (per-channel weights, dynamic per-token activations).
    backend : str
        ``"auto"`` or a backend name (see ``fp8ref.linear``).
    precision : str
        Required precision class, default ``"standard"``.
    candidates : sequence of str, optional
        The backends ``"auto"`` may choose among (see ``fp8ref.linear``).
    weight_check : {"sample", "version", "content"}, optional
        How a change to the ``weight``/``weight_scale`` buffers is noticed (see ``fp8ref.linear``):
        ``"sample"`` (default) also sees writes through ``.data`` and numpy views that change a
        sampled code or any scale, ``"content"`` every write, at a read of the codes per call.
    out_dtype : torch.dtype, optional
        Output dtype (default: the input's).
    dtype : torch.dtype
        dtype of the bias.

    Attributes
    ----------
    weight : torch.Tensor (buffer)
        FP8 codes ``[out_features, in_features]``.
    weight_scale : torch.Tensor (buffer)
        Dequantization scales, ``recipe.weight.scale_shape(out, in)`` (``[N, 1]`` per channel).
    bias : nn.Parameter or None

    Examples
    --------
    >>> import torch, fp8ref
    >>> lin = torch.nn.Linear(64, 32)
    >>> q = fp8ref.Fp8Linear.from_linear(lin, backend="reference")
    >>> q(torch.randn(4, 64)).shape
    torch.Size([4, 32])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Recipe | str = W8A8_FP8, backend: str = "auto", precision: str = "standard",
                 out_dtype: torch.dtype | None = None, device=None, dtype: torch.dtype = torch.float32,
                 candidates: Sequence[str] | None = None, weight_check: str | None = None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.recipe = get_recipe(recipe)
        self.backend, self.precision, self.out_dtype = backend, precision, out_dtype
        self.candidates = None if candidates is None else tuple(candidates)
        self.weight_check = weight_check
        w = self.recipe.weight
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=w.format.torch_dtype,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones(w.scale_shape(out_features, in_features),
                                                        dtype=w.scale_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self._qw: Quantized | None = None
        self._qw_key: tuple | None = None
        self._bound: dict[tuple, _Bound] = {}
        self._prepared: dict[str, Any] = {}
        self._prepared_key: tuple | None = None
        self._sample: MemorySample | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | str = W8A8_FP8, backend: str = "auto",
                    precision: str = "standard", out_dtype: torch.dtype | None = None, *,
                    candidates: Sequence[str] | None = None,
                    weight_check: str | None = None) -> Fp8Linear:
        """Quantize an ``nn.Linear``'s weight (reference quantizer, once) into a new ``Fp8Linear``.

        Examples
        --------
        >>> import torch, fp8ref
        >>> q = fp8ref.Fp8Linear.from_linear(torch.nn.Linear(16, 8, dtype=torch.float16))
        >>> q.weight.dtype, tuple(q.weight_scale.shape)
        (torch.float8_e4m3fn, (8, 1))
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        recipe = get_recipe(recipe)
        w = linear.weight.detach()
        check_dense(w, "linear.weight")  # a meta model has no values to quantize
        check_float_input(w, "linear.weight")
        if linear.bias is not None:
            check_dense(linear.bias, "linear.bias")
            check_finite(linear.bias.detach(), "linear.bias")
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe,
                  backend=backend, precision=precision, out_dtype=out_dtype, device=w.device, dtype=w.dtype,
                  candidates=candidates, weight_check=weight_check)
        with torch.no_grad():
            q = quantize(w, recipe.weight)
            mod.weight.copy_(q.data)
            mod.weight_scale.copy_(q.scale)
            if linear.bias is not None:
                mod.bias.copy_(linear.bias.detach())
        return mod

    @classmethod
    def from_quantized(cls, qw: Quantized, bias: torch.Tensor | None = None, *, recipe: Recipe | str = W8A8_FP8,
                       backend: str = "auto", precision: str = "standard",
                       out_dtype: torch.dtype | None = None, candidates: Sequence[str] | None = None,
                       weight_check: str | None = None) -> Fp8Linear:
        """Wrap an already quantized weight (e.g. read from a checkpoint); its codes must be finite
        and its scales finite and > 0, a bias ``[N]`` float and finite (``ValueError`` otherwise)."""
        recipe = get_recipe(recipe)
        if not isinstance(qw, Quantized):
            raise TypeError(f"qw must be an fp8ref.Quantized, got {type(qw).__name__}")
        if qw.scheme != recipe.weight:
            raise ValueError(f"weight quantized as {qw.scheme.short_str()}, recipe {recipe.name} expects "
                             f"{recipe.weight.short_str()}")
        check_dense(qw.data, "qw.data")
        check_dense(qw.scale, "qw.scale")
        check_codes(qw, "qw")
        N, K = qw.data.shape
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (N,):
                raise ValueError(f"bias must be a float tensor of shape ({N},) = [N], got "
                                 f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}"
                                 f"{'' if not isinstance(bias, torch.Tensor) else ' ' + str(bias.dtype)}")
            check_finite(bias, "bias")
        dtype = bias.dtype if bias is not None else torch.float32
        mod = cls(K, N, bias is not None, recipe=recipe, backend=backend, precision=precision,
                  out_dtype=out_dtype, device=qw.data.device, dtype=dtype, candidates=candidates,
                  weight_check=weight_check)
        with torch.no_grad():
            mod.weight.copy_(qw.data)
            mod.weight_scale.copy_(qw.scale)
            if bias is not None:
                mod.bias.copy_(bias)
        return mod

    def quantized_weight(self) -> Quantized:
        """The weight as a ``Quantized`` (cached; rebuilt when the buffers change or move)."""
        key = (self.weight.data_ptr(), tensor_version(self.weight), self.weight_scale.data_ptr(),
               tensor_version(self.weight_scale))
        if self._qw is None or key != self._qw_key:
            self._qw = Quantized(self.weight, self.weight_scale, self.recipe.weight)
            self._qw_key = key
        return self._qw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fp8ref.linear(x, self.quantized_weight(), self.bias, ...)``, by the layer's fast path.

        The layer owns its weight, so the first call of a case (x's dtype, device and M bucket)
        checks everything ``fp8ref.linear`` checks, resolves the backend and prepares the weight
        once; later calls of that case check x's type, dtype, device and K, that nothing the
        choice depends on changed (the weight's and scale's storage, version and strides, the
        layer's settings, the bias object, the selector's generation, the environment variables
        ``fp8ref.linear`` reads, and under ``weight_check="sample"`` a sample of the codes and all
        the scales against their values when the weight was prepared), scan x and the bias for
        NaN/Inf unless the backend does, and call the backend's ``linear``. Grad mode with an
        input that requires grad, a thread that flushes subnormals, ``weight_check="content"``,
        and a backend that raises go through
        ``fp8ref.linear`` itself (its errors, its byte comparison, its fallback under ``"auto"``).
        Under ``torch.compile`` / ``torch.export`` the layer is one ``torch.ops.fp8ref.linear``.
        """
        if torch.compiler.is_compiling():  # torch.compile / torch.export: one opaque op (fp8ref.ops)
            cands = None if self.candidates is None else ",".join(self.candidates)
            return linear_op(x, self.weight, self.weight_scale, self.bias, recipe=recipe_key(self.recipe),
                             backend=self.backend, precision=self.precision, out_dtype=self.out_dtype,
                             candidates=cands, weight_check=self.weight_check)
        if type(x) is torch.Tensor and x.dim() >= 1 and x.shape[-1] == self.in_features:
            shape = x.shape
            x2 = x if len(shape) == 2 else x.reshape(-1, self.in_features)
            M = x2.shape[0]
            bias = self.bias
            key = ((M - 1).bit_length() if M > 1 else 0, x.dtype, x.device)
            state = self._state()
            b = self._bound.get(key)
            if (b is None or b.state != state or b.bias is not bias
                    or (b.sample is not None and not b.sample.same())):
                b = self._bind(x, x2, key, state)
            if (b is not None
                    and not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)))
                    and not flushing()):
                try:
                    if not b.backend.rejects_non_finite:
                        check_values(x, bias)
                    y = b.backend.linear(x2, b.prepared, bias, b.out_dtype, b.scheme)
                    return y if len(shape) == 2 else y.reshape(*shape[:-1], self.out_features)
                except Exception:  # fp8ref.linear, next, raises the caller's error or falls back ("auto")
                    pass
        return linear(x, self.quantized_weight(), self.bias, recipe=self.recipe, backend=self.backend,
                      precision=self.precision, out_dtype=self.out_dtype, candidates=self.candidates,
                      weight_check=self.weight_check)

    def _state(self) -> tuple:
        """What a bound call depends on besides x: the weight's storage and version, the layer's
        settings, the selector's generation, the environment variables that force or restrict the
        choice."""
        w, s, env = self.weight, self.weight_scale, os.environ
        return (w.data_ptr(), tensor_version(w), w.stride(), s.data_ptr(), tensor_version(s), s.stride(), self.recipe,
                self.backend, self.precision, self.out_dtype, self.candidates, self.weight_check, generation(),
                env.get(ENV_BACKEND), env.get(ENV_CANDIDATES), env.get(ENV_ALLOW), env.get(ENV_WEIGHT_CHECK))

    def _bind(self, x: torch.Tensor, x2: torch.Tensor, key: tuple, state: tuple) -> _Bound | None:
        """Check the call as ``fp8ref.linear`` does, resolve its backend and prepare the weight for
        it (once per backend and weight version); on any error, bind nothing (``fp8ref.linear``,
        which runs next, raises it)."""
        self._bound.pop(key, None)
        try:
            qw = self.quantized_weight()
            recipe, od = check_linear_args(x, qw, self.bias, recipe=self.recipe, out_dtype=self.out_dtype)
            check = self.weight_check or state[-1] or "sample"
            if not recipe.activation.dynamic or check not in ("sample", "version"):
                return None  # fp8ref.linear raises, or compares the weight's bytes on every call
            case = Case(M=x2.shape[0], N=self.out_features, K=self.in_features, recipe=recipe, x_dtype=x.dtype,
                        out_dtype=od, device=str(x.device), has_bias=self.bias is not None)
            backend, _ = resolve(case, self.backend, self.precision, candidates=self.candidates)
            sample = self._sample
            if (self._prepared_key != state[:6] or (check == "sample") != (sample is not None)
                    or (sample is not None and not sample.same())):
                # Taken before preparing: a write after it gives prepared forms newer than the
                # sample (the next call prepares again), never older.
                sample = MemorySample(self.weight, (self.weight_scale,)) if check == "sample" else None
                self._prepared, self._prepared_key, self._sample = {}, state[:6], sample
            prepared = self._prepared.get(backend.name)
            if prepared is None:
                prepared = self._prepared[backend.name] = backend.prepare_weight(qw)
        except Exception:  # fp8ref.linear, called next, raises it with its own wording
            return None
        b = self._bound[key] = _Bound(state, backend, prepared, recipe.activation, od, self.bias, sample)
        return b

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.quantized_weight().dequantize(dtype)

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ``.float()``, ``.cuda()``... with the FP8 codes and scales kept.

        A conversion that would change the dtype of ``weight`` or ``weight_scale`` (a cast of the
        whole model: ``model.half()``, ``model.to(torch.bfloat16)``) moves them to the device it
        asks for and leaves their dtype alone: the layer stays the same FP8 layer. The bias is cast,
        and an explicit ``out_dtype`` follows the cast (with ``out_dtype=None`` the output already
        follows the input). Device moves and dtype-preserving conversions apply as usual.
        """
        codes, scale = self._buffers.get("weight"), self._buffers.get("weight_scale")

        def keep_formats(t: torch.Tensor) -> torch.Tensor:
            if t is codes or t is scale:
                target = fn(torch.empty(0, dtype=t.dtype, device=t.device))  # where and as what fn sends t
                if target.dtype != t.dtype:
                    return t.to(device=target.device)
            return fn(t)

        if self.out_dtype is not None and self.out_dtype.is_floating_point:
            target = fn(torch.empty(0, dtype=self.out_dtype))
            if target.dtype.is_floating_point and target.dtype.itemsize > 1:
                self.out_dtype = target.dtype
        return super()._apply(keep_formats, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe.name}, backend={self.backend!r}, precision={self.precision!r}")


@dataclass(frozen=True)
class _Bound:
    """One case of an ``Fp8Linear`` resolved: the backend, its prepared weight, and the state
    (``Fp8Linear._state``), bias object and memory sample (under ``weight_check="sample"``) it
    was resolved for."""

    state: tuple
    backend: Backend
    prepared: Any
    scheme: Any
    out_dtype: torch.dtype
    bias: Any
    sample: MemorySample | None
