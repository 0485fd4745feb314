"""Online FP8 quantization of a layer: ``Fp8Linear``.

``Fp8Linear`` stores the weight once as FP8 codes plus dequantization scales (buffers ``weight``
and ``weight_scale``, the compressed-tensors names), keeps the bias as it was, and runs
``fp8ref.linear`` in ``forward`` (backend "auto" by default: the fastest compliant backend).
``fp8ref.surgery.quantize_model`` swaps every ``nn.Linear`` of a model for one, in place. With
``dense_fallback="auto"`` a layer also keeps its original weight and runs ``F.linear`` on it in the
M buckets where FP8 measured slower (``fp8ref.select.dense``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .api import LayerPlans, Plan, linear
from .ops import linear_op, recipe_key
from .select import dense as _dense
from .select.cache import generation as _generation
from .select.keys import m_bucket
from .spec.checks import check_bias, check_codes, check_dense, check_finite
from .spec.quant import Quantized, check_float_input, quantize
from .spec.schemes import W8A8_FP8, Recipe, get_recipe
from .weightcheck import pair_version, tensor_version

__all__ = ["Fp8Linear"]


def _setting(name: str, doc: str, convert=None) -> property:
    """A layer setting its plans depend on: setting it drops them (the next call plans again)."""
    attr = "_" + name

    def get(self):
        return self.__dict__[attr]

    def set(self, value):
        self.__dict__[attr] = value if convert is None else convert(value)
        self.__dict__["_plans"] = None

    return property(get, set, doc=doc)


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
    dense_fallback : {None, "auto"}
        Whether the layer keeps its original weight for the M buckets where FP8 measured slower
        (``from_linear(..., dense_fallback="auto")``; None for a layer built any other way).
    dense_weight : torch.Tensor (non-persistent buffer), only with ``dense_fallback="auto"``
        The original weight, in its dtype: what a call that runs dense computes with
        (``F.linear(x, dense_weight, bias)``). Not in the state dict (see ``from_linear``).

    Examples
    --------
    >>> import torch, fp8ref
    >>> lin = torch.nn.Linear(64, 32)
    >>> q = fp8ref.Fp8Linear.from_linear(lin, backend="reference")
    >>> q(torch.randn(4, 64)).shape
    torch.Size([4, 32])
    """

    recipe = _setting("recipe", "The quantization recipe.", get_recipe)
    backend = _setting("backend", '``"auto"`` or a backend name.')
    precision = _setting("precision", "The required precision class.")
    out_dtype = _setting("out_dtype", "The output dtype (None: the input's).")
    candidates = _setting("candidates", "The backends ``\"auto\"`` may choose among (None: the default set).",
                          lambda c: None if c is None else tuple(c))
    weight_check = _setting("weight_check", "How a change to the weight is noticed (see ``fp8ref.linear``).")
    # The dense fallback's state (set per instance by __init__ and from_linear); the class holds
    # "off" for a layer pickled before it existed.
    dense_fallback: str | None = None
    _dense_on = False
    _dense_dropped: str | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Recipe | str = W8A8_FP8, backend: str = "auto", precision: str = "standard",
                 out_dtype: torch.dtype | None = None, device=None, dtype: torch.dtype = torch.float32,
                 candidates: Sequence[str] | None = None, weight_check: str | None = None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self._plans: LayerPlans | None = None
        self.recipe = get_recipe(recipe)
        self.backend, self.precision, self.out_dtype = backend, precision, out_dtype
        self.candidates = candidates
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
        self.dense_fallback: str | None = None
        self._dense_on = False  #: a kept dense weight is consulted on each eager call
        self._dense_choices: dict[tuple[int, torch.dtype], _dense.DenseChoice] = {}
        self._dense_gen = _generation()
        self._dense_version: tuple | None = None  #: the codes' and scales' version the kept weight matches
        self._dense_dropped: str | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | str = W8A8_FP8, backend: str = "auto",
                    precision: str = "standard", out_dtype: torch.dtype | None = None, *,
                    candidates: Sequence[str] | None = None,
                    weight_check: str | None = None, dense_fallback: str | None = None) -> Fp8Linear:
        """Quantize an ``nn.Linear``'s weight (reference quantizer, once) into a new ``Fp8Linear``.

        With ``dense_fallback="auto"`` the layer also keeps a copy of the original weight, in its
        dtype, as the non-persistent buffer ``dense_weight`` (it costs the original weight's memory
        again), and decides once per M bucket and x dtype (at the bucket's first eager call, by a
        paired timing of its own FP8 call against ``F.linear`` on that weight:
        ``fp8ref.select.dense``) whether that bucket's calls run ``F.linear(x, dense_weight, bias)``
        instead of FP8: where FP8 measured slower. Such a call computes the unquantized layer,
        outside the W8A8 contract (docs/spec.md), without fp8ref's NaN/Inf checks of x; it applies
        only where x has the kept weight's dtype and device and the output dtype is x's. Under
        ``torch.compile``/``torch.export`` (the custom op) every call runs FP8. The kept weight is
        not in the state dict (a checkpoint stays the FP8 layer's); a change to the codes or scales
        after quantization (``load_state_dict``, an in-place write) makes it another layer's
        weight: the layer then drops it, with a warning, and runs FP8. Default None: no copy, no
        decision, the layer as without the argument.

        Examples
        --------
        >>> import torch, fp8ref
        >>> q = fp8ref.Fp8Linear.from_linear(torch.nn.Linear(16, 8, dtype=torch.float16))
        >>> q.weight.dtype, tuple(q.weight_scale.shape)
        (torch.float8_e4m3fn, (8, 1))
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        _dense.check_dense_fallback(dense_fallback)
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
        if dense_fallback == "auto":
            mod.register_buffer("dense_weight", w.clone(), persistent=False)
            mod.dense_fallback = dense_fallback
            mod._dense_on = True
            mod._dense_version = pair_version(mod.weight, mod.weight_scale)
        return mod

    @classmethod
    def from_quantized(cls, qw: Quantized, bias: torch.Tensor | None = None, *, recipe: Recipe | str = W8A8_FP8,
                       backend: str = "auto", precision: str = "standard",
                       out_dtype: torch.dtype | None = None, candidates: Sequence[str] | None = None,
                       weight_check: str | None = None) -> Fp8Linear:
        """Wrap an already quantized weight (e.g. read from a checkpoint); its codes must be finite
        and its scales finite and > 0, a bias ``[N]`` float and finite (``ValueError``, and ``TypeError`` for
        a bias that is not a float tensor, otherwise)."""
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
        check_bias(bias, N)
        if bias is not None:
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
        """``fp8ref.linear(x, self.quantized_weight(), self.bias, ...)``, by the layer's plans.

        The layer holds one ``fp8ref.api.LayerPlans``: the first call of a case (x's dtype, device
        and M bucket) checks everything ``fp8ref.linear`` checks, resolves the backend and prepares
        the weight once (the environment is read then); later calls of that case look the plan up,
        check that it is current (the selector's generation, the weight's and scale's storage,
        version and strides, and under ``weight_check="sample"`` a sample of the codes and all the
        scales against their values when the weight was prepared) and that the bias is the object
        it was checked with, scan x and the bias for NaN/Inf unless the backend does, and call the
        backend's ``linear``. A change to a setting (``backend``, ``precision``, ``out_dtype``,
        ``candidates``, ``weight_check``, ``recipe``) drops the plans. Grad mode with an input that
        requires grad, ``weight_check="content"``, a call that does not check out and a backend
        that raises go through ``fp8ref.linear`` itself (its errors, its byte comparison, its
        fallback under ``"auto"``). Under ``torch.compile`` / ``torch.export`` the layer is one
        ``torch.ops.fp8ref.linear``. With ``dense_fallback="auto"`` (``from_linear``) an eager call
        in an M bucket decided dense is ``F.linear(x, self.dense_weight, self.bias)``.
        """
        if torch.compiler.is_compiling():  # torch.compile / torch.export: one opaque op (fp8ref.ops)
            cands = None if self.candidates is None else ",".join(self.candidates)
            return linear_op(x, self.weight, self.weight_scale, self.bias, recipe=recipe_key(self.recipe),
                             backend=self.backend, precision=self.precision, out_dtype=self.out_dtype,
                             candidates=cands, weight_check=self.weight_check)
        if self._dense_on:  # dense_fallback="auto" (from_linear)
            y = self._dense_forward(x)
            if y is not None:
                return y
        plans = self._plans
        if plans is None:
            plans = self._new_plans()
        buffers = self._buffers
        # a bias parameter from its table: nn.Module.__getattr__ is the slow lookup (docs/performance.md)
        # (a bias of None, or a plain tensor set later, is an instance attribute: a fast lookup)
        params = self._parameters
        y = plans.run(x, buffers["weight"], buffers["weight_scale"],
                      params["bias"] if "bias" in params else self.bias)
        if y is not None:
            return y
        return linear(x, self.quantized_weight(), self.bias, recipe=self.recipe, backend=self.backend,
                      precision=self.precision, out_dtype=self.out_dtype, candidates=self.candidates,
                      weight_check=self.weight_check)

    def _new_plans(self) -> LayerPlans:
        d = self.__dict__
        plans = d["_plans"] = LayerPlans(d["_recipe"], d["_backend"], d["_precision"], d["_out_dtype"],
                                         d["_candidates"], d["_weight_check"])
        return plans

    def _dense_forward(self, x) -> torch.Tensor | None:
        """``F.linear(x, dense_weight, bias)`` where x's bucket is decided dense (deciding it at its
        first call), else None: the FP8 path takes the call."""
        w = self._buffers.get("dense_weight")
        if (type(x) is not torch.Tensor or not x.dim() or w is None or x.dtype != w.dtype or x.device != w.device
                or x.shape[-1] != self.in_features or self.out_dtype not in (None, x.dtype)):
            return None
        M = math.prod(x.shape[:-1])
        if self._dense_gen != _generation():  # fp8ref.select.clear_cache(): timed decisions are made again
            self._dense_choices = {k: c for k, c in self._dense_choices.items() if c.source == "forced"}
            self._dense_gen = _generation()
        c = self._dense_choices.get((m_bucket(M), x.dtype))
        if c is None:
            c = self.decide_dense(M, x.dtype)
        if not c.dense:
            return None
        if pair_version(self.weight, self.weight_scale) != self._dense_version:
            self._drop_dense("the FP8 weight or its scales were written after quantization (load_state_dict, an "
                             "in-place write), so the kept dense weight is no longer this layer's")
            return None
        return F.linear(x, w, self.bias)

    def decide_dense(self, M: int, dtype: torch.dtype | None = None, *, dense: bool | None = None
                     ) -> _dense.DenseChoice:
        """Decide now whether eager calls with ``M`` rows (their M bucket) run dense: by the paired
        timing of ``fp8ref.select.dense.decide`` (the layer's own FP8 call, without hooks, against
        ``F.linear`` on the kept weight, at min(bucket, ``TIME_M_CAP``) rows), or, with
        ``dense=True``/``False``, as given. ``dtype``, x's dtype, must be the kept weight's (the
        default; an x of another dtype runs FP8). Needs ``dense_fallback="auto"`` (``ValueError``
        otherwise).

        The timing runs the layer's FP8 path with the dense path switched off on the instance
        meanwhile: a call from another thread during it runs FP8.

        Examples
        --------
        >>> import torch, fp8ref
        >>> q = fp8ref.Fp8Linear.from_linear(torch.nn.Linear(16, 8), backend="reference", dense_fallback="auto")
        >>> q.decide_dense(128, dense=True).short_str()
        'M<=128: dense (forced)'
        """
        w = self._buffers.get("dense_weight")
        if w is None:
            dropped = "" if self._dense_dropped is None else f" (its dense weight was dropped: {self._dense_dropped})"
            raise ValueError(f"decide_dense needs a layer built with Fp8Linear.from_linear(..., dense_fallback="
                             f"'auto'){dropped}")
        if isinstance(M, bool) or not isinstance(M, int) or M < 0:
            raise ValueError(f"M must be an int >= 0, got {M!r}")
        dtype = w.dtype if dtype is None else dtype
        if dtype != w.dtype:
            raise ValueError(f"dtype must be the kept weight's dtype {w.dtype} (x of another dtype runs FP8), got "
                             f"{dtype!r}")
        if dense is not None:
            c = _dense.forced(M, dense)
        else:
            c = self._timed_choice(M, dtype, w)
        self._dense_choices[(c.bucket, dtype)] = c
        return c

    def _timed_choice(self, M: int, dtype: torch.dtype, w: torch.Tensor) -> _dense.DenseChoice:
        gen = torch.Generator().manual_seed(2)
        xt = torch.randn(_dense.timed_rows(M), self.in_features, generator=gen).to(dtype).to(w.device)
        bias = self.bias
        fp8_side = (f"{self.recipe.short_str()}|backend={self.backend}|precision={self.precision}|"
                    f"cands={self.candidates}|out={self.out_dtype}|check={self.weight_check}")
        key = _dense.dense_key(N=self.out_features, K=self.in_features, M=M, x_dtype=dtype, device=w.device,
                               has_bias=bias is not None, fp8=fp8_side)
        d = self.__dict__
        on, d["_dense_on"] = d["_dense_on"], False  # the FP8 side is this layer's call without the dense path
        try:
            with torch.no_grad():
                return _dense.decide(key, M, lambda: self.forward(xt),
                                     lambda: F.linear(xt, w, bias), w.device)
        finally:
            d["_dense_on"] = on

    def _drop_dense(self, why: str) -> None:
        self._buffers.pop("dense_weight", None)
        self._dense_on, self._dense_dropped = False, why
        self._dense_choices = {}
        warnings.warn(f"Fp8Linear({self.in_features}, {self.out_features}): dense fallback dropped: {why}; its calls "
                      "run FP8", RuntimeWarning, stacklevel=3)

    def dense_decisions(self) -> list[tuple[torch.dtype, _dense.DenseChoice]]:
        """The dense fallback's decisions so far, as (x dtype, ``DenseChoice``), by dtype then bucket."""
        return [(dt, c) for (_, dt), c in sorted(self._dense_choices.items(), key=lambda kv: (str(kv[0][1]), kv[0][0]))]

    def plan(self, x: torch.Tensor) -> Plan | None:
        """The plan a call on ``x`` runs (built now if needed), or None where ``fp8ref.linear`` or the
        dense fallback takes the call (see ``forward``)."""
        with torch.no_grad():
            self(x)
        c = self._dense_choices.get((m_bucket(math.prod(x.shape[:-1])), x.dtype)) if self._dense_on else None
        if c is not None and c.dense:
            return None
        plans = self._plans
        if plans is None or type(x) is not torch.Tensor or not x.dim():
            return None
        return plans.plans.get((m_bucket(math.prod(x.shape[:-1])), x.dtype, x.device))

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
        fresh = self._dense_on and pair_version(self.weight, self.weight_scale) == self._dense_version
        out = super()._apply(keep_formats, recurse)
        if fresh:  # the codes and the kept weight moved together: still the same layer
            self._dense_version = pair_version(self.weight, self.weight_scale)
        return out

    def extra_repr(self) -> str:
        text = (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe.name}, backend={self.backend!r}, precision={self.precision!r}")
        if self.dense_fallback is not None:
            dense = [f"{str(dt)[6:]} {c.short_str()}" for dt, c in self.dense_decisions() if c.dense]
            state = (f"dropped: {self._dense_dropped}" if self._dense_dropped is not None
                     else "dense at " + ", ".join(dense) if dense else "no bucket dense so far")
            text += f", dense_fallback={self.dense_fallback!r} ({state})"
        return text


