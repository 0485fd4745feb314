"""fp8ref's linear as a PyTorch custom operator, ``torch.ops.fp8ref.linear``, for ``torch.compile``
and ``torch.export``.

The backends run C++ extensions, Triton kernels and third-party code that tracing cannot enter
(``torch._dynamo`` breaks the graph at each pybind11 call; ``torch.export`` fails on the first
data pointer it meets). ``fp8ref::linear`` wraps the whole of ``fp8ref.linear`` (checks, selection,
the chosen backend's kernel) as one opaque operator with a fake implementation that gives the
output's shape ``[..., N]``, dtype and device from the inputs' metadata alone. A traced model holds
one ``fp8ref.linear`` node per layer; the selection happens when the node runs, outside the traced
region, exactly as in eager mode, so a compiled or exported model computes what the eager one does,
bit for bit.

``Fp8Linear.forward`` calls the operator when it is being compiled or exported
(``torch.compiler.is_compiling()``) and ``fp8ref.linear`` directly otherwise (the operator's own
dispatch costs microseconds a decode step need not pay). The operator is registered with the CPU
and CUDA keys alike (``torch.library.custom_op`` with no device types): the same op runs wherever
fp8ref's backends do.

Imports flow downward: this module imports ``fp8ref.api`` and the spec, and ``fp8ref.nn`` imports it.

Examples
--------
>>> import torch, fp8ref
>>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
>>> _ = fp8ref.quantize_model(m, skip=())
>>> x = torch.randn(4, 64)
>>> with torch.no_grad():
...     ep = torch.export.export(m, (x,))
...     torch.equal(ep.module()(x), m(x))
True
>>> q = m[0]
>>> torch.ops.fp8ref.linear(x, q.weight, q.weight_scale, q.bias, recipe="w8a8_fp8", backend="reference",
...                         precision="standard", out_dtype=None).shape
torch.Size([4, 64])
"""

from __future__ import annotations

import weakref

import torch

from .api import LayerPlans
from .api import linear as _linear
from .spec.quant import Quantized
from .spec.schemes import RECIPES, Recipe

__all__ = ["linear_op", "recipe_key"]

#: Recipes that are not presets, by the key ``recipe_key`` gave them (an op argument is a str).
_CUSTOM_RECIPES: dict[str, Recipe] = {}


def recipe_key(recipe: Recipe) -> str:
    """The str that names ``recipe`` in an ``fp8ref::linear`` call: a preset's name, or a key
    registered for this process (a custom recipe; an exported program that uses one runs in a
    process that has built the same recipe's ``Fp8Linear``)."""
    if RECIPES.get(recipe.name) == recipe:
        return recipe.name
    key = f"custom:{recipe.short_str()}"
    _CUSTOM_RECIPES.setdefault(key, recipe)
    return key


def _recipe(key: str) -> Recipe:
    r = RECIPES.get(key) or _CUSTOM_RECIPES.get(key)
    if r is None:
        raise ValueError(f"fp8ref::linear: unknown recipe {key!r}: a preset ({sorted(RECIPES)}) or a custom recipe "
                         "whose Fp8Linear was built in this process")
    return r


#: Per (weight, weight_scale, settings): the tensors' weakrefs, the plans (``fp8ref.api.LayerPlans``,
#: as an ``Fp8Linear`` holds them) and the Quantized view ``fp8ref.linear`` takes when the plans do not
#: run a call (its weight cache, keyed by the Quantized's identity, then hits on every such call).
_LAYERS: dict[tuple, tuple[weakref.ref, weakref.ref, LayerPlans, Quantized]] = {}


def _layer(weight: torch.Tensor, weight_scale: torch.Tensor, settings: tuple) -> tuple:
    key = (id(weight), id(weight_scale), *settings)
    hit = _LAYERS.get(key)
    if hit is not None and hit[0]() is weight and hit[1]() is weight_scale:
        return hit
    rkey, backend, precision, out_dtype, candidates, weight_check = settings
    r = _recipe(rkey)

    def _drop(_ref, key=key, cache=_LAYERS):  # bound now: module globals are gone at interpreter exit
        cache.pop(key, None)

    plans = LayerPlans(r, backend, precision, out_dtype, None if candidates is None else tuple(candidates.split(",")),
                       weight_check)
    hit = _LAYERS[key] = (weakref.ref(weight, _drop), weakref.ref(weight_scale, _drop), plans,
                          Quantized(weight, weight_scale, r.weight))
    return hit


@torch.library.custom_op("fp8ref::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, *,
              recipe: str, backend: str, precision: str, out_dtype: torch.dtype | None,
              candidates: str | None = None, weight_check: str | None = None) -> torch.Tensor:
    """``fp8ref.linear(x, Quantized(weight, weight_scale, recipe.weight), bias, ...)`` as one operator.

    Parameters
    ----------
    x : torch.Tensor
        Activations ``[..., K]``.
    weight, weight_scale : torch.Tensor
        FP8 codes ``[N, K]`` and their dequantization scales (``Fp8Linear``'s buffers).
    bias : torch.Tensor or None
    recipe : str
        ``recipe_key(recipe)``: a preset name.
    backend, precision : str
        As ``fp8ref.linear`` takes them (``"auto"`` selects when the op runs).
    out_dtype : torch.dtype or None
    candidates : str, optional
        Backend names separated by commas (an op takes no list of str).
    weight_check : str, optional
        As ``fp8ref.linear`` takes it.
    """
    _, _, plans, qw = _layer(weight, weight_scale, (recipe, backend, precision, out_dtype, candidates, weight_check))
    y = plans.run(x, weight, weight_scale, bias)
    if y is None:
        y = _linear(x, qw, bias, recipe=plans.recipe, backend=backend, precision=precision, out_dtype=out_dtype,
                    candidates=plans.candidates, weight_check=weight_check)
    # A custom op's output may not alias an input: copy in the (empty-input) cases where a
    # backend's result could be a view of x.
    return y.clone() if y._is_view() else y


@linear_op.register_fake
def _linear_fake(x, weight, weight_scale, bias, *, recipe, backend, precision, out_dtype, candidates=None,
                 weight_check=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype if out_dtype is None else out_dtype)
