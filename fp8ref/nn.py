"""Online FP8 quantization of a layer: ``Fp8Linear``.

``Fp8Linear`` stores the weight once as FP8 codes plus dequantization scales (buffers ``weight``
and ``weight_scale``, the compressed-tensors names), keeps the bias as it was, and runs
``fp8ref.linear`` in ``forward`` (backend "auto" by default: the fastest compliant backend).
``fp8ref.surgery.quantize_model`` swaps every ``nn.Linear`` of a model for one, in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .api import LayerPlans, Plan, linear
from .ops import linear_op, recipe_key
from .select.keys import m_bucket
from .spec.checks import check_bias, check_codes, check_dense, check_finite
from .spec.quant import Quantized, check_float_input, quantize
from .spec.schemes import W8A8_FP8, Recipe, get_recipe
from .weightcheck import tensor_version

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
        ``torch.ops.fp8ref.linear``.
        """
        if torch.compiler.is_compiling():  # torch.compile / torch.export: one opaque op (fp8ref.ops)
            cands = None if self.candidates is None else ",".join(self.candidates)
            return linear_op(x, self.weight, self.weight_scale, self.bias, recipe=recipe_key(self.recipe),
                             backend=self.backend, precision=self.precision, out_dtype=self.out_dtype,
                             candidates=cands, weight_check=self.weight_check)
        plans = self._plans
        if plans is None:
            plans = self._new_plans()
        buffers = self._buffers
        y = plans.run(x, buffers["weight"], buffers["weight_scale"], self.bias)
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

    def plan(self, x: torch.Tensor) -> Plan | None:
        """The plan a call on ``x`` runs (built now if needed), or None where ``fp8ref.linear`` takes
        the call (see ``forward``)."""
        with torch.no_grad():
            self(x)
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
        return super()._apply(keep_formats, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe.name}, backend={self.backend!r}, precision={self.precision!r}")


