"""Model surgery: ``quantize_model`` swaps a model's ``nn.Linear`` layers for ``Fp8Linear``, in
place, keeping what the model does: a shared layer stays one layer, hooks and train/eval mode move
to the replacement, and layers whose use is not a call (attention reading a projection's weight)
or whose behaviour is not ``nn.Linear``'s are left as they are, with the reason.
``fp8ref.checkpoint`` uses the same helpers when it loads FP8 layers into a model.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn
from torch.nn.utils import parametrize

from .nn import Fp8Linear
from .select.dense import check_dense_fallback
from .spec.schemes import W8A8_FP8, Recipe, get_recipe

__all__ = ["QuantizeSummary", "quantize_model"]


@dataclass
class QuantizeSummary:
    """What ``quantize_model`` did."""

    layers: int  #: nn.Linear modules replaced
    parameters: int  #: weight elements quantized
    bytes_before: int  #: bytes of the model's parameters and buffers before
    bytes_after: int  #: and after
    quantized: list[str] = field(default_factory=list)  #: every name of every layer replaced
    skipped: list[str] = field(default_factory=list)  #: every name of every nn.Linear left as it was
    reasons: dict[str, str] = field(default_factory=dict)  #: why each skipped name was left
    dense_fallback: str | None = None  #: ``quantize_model``'s argument
    #: layers that keep their original weight for the dense fallback (each once, however many names)
    dense_layers: int = 0
    #: bytes of those kept weights (counted in ``bytes_after``)
    dense_bytes: int = 0

    def __post_init__(self) -> None:
        self._layers: dict[str, Fp8Linear] = {}  # first name -> layer (not a field: asdict leaves it)

    def dense_decisions(self) -> list[dict]:
        """The dense fallback's decisions made so far (a layer decides a bucket at its first eager
        call there), one dict per layer (by its first name), x dtype and M bucket: ``layer``, ``N``,
        ``K``, ``dtype`` and the fields of its ``fp8ref.select.dense.DenseChoice`` (``bucket``,
        ``dense``, ``ratio``: FP8's speed over dense's, None when forced, ...)."""
        out = []
        for name, mod in self._layers.items():
            for dt, c in mod.dense_decisions():
                out.append({"layer": name, "N": mod.out_features, "K": mod.in_features, "dtype": str(dt)[6:],
                            **c.as_dict()})
        return out

    def __str__(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else float("nan")
        text = (f"quantized {self.layers} linear layers ({self.parameters:,} weights), skipped "
                f"{len(self.skipped)}; model {self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB "
                f"({ratio:.2f}x)")
        if self.dense_fallback is not None:
            made = self.dense_decisions()
            dense = sorted({(d["N"], d["K"], d["dtype"], d["bucket"]) for d in made if d["dense"]})
            shapes = ", ".join(f"{n}x{k} {dt} M<={b}" for n, k, dt, b in dense) or "none so far"
            text += (f"; dense fallback {self.dense_fallback!r}: {self.dense_layers} layers keep their original "
                     f"weight (+{self.dense_bytes / 2**20:.1f} MiB, counted above), "
                     f"{sum(d['dense'] for d in made)} of {len(made)} (layer, bucket) decisions run dense "
                     f"(NxK dtype bucket: {shapes})")
        return text


def _model_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    for pat in skip:
        if name == pat or name.endswith("." + pat) or fnmatch.fnmatchcase(name, pat):
            return True
    return False


#: The hook tables of a module that ``quantize_model`` hands to the replacement as they are (the
#: same dictionaries, so a handle the user holds still removes its hook).
_CARRIED_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
#: Hook tables that assume the float layer's state (names, dtypes): a layer with one is left as it is.
_STATE_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


#: torch modules that use their ``nn.Linear`` children's weights without calling them: an
#: ``Fp8Linear`` there would hand them FP8 codes (a dtype error, or worse).
_READS_WEIGHTS = {
    nn.MultiheadAttention: "reads its projections' weights directly (F.multi_head_attention_forward) instead "
                           "of calling them",
    nn.TransformerEncoderLayer: "reads linear1's and linear2's weights directly on its fast path "
                                "(torch._transformer_encoder_layer_fwd, taken in eval mode without grad)",
}


def _custom_reason(mod: nn.Linear) -> str | None:
    """Why ``mod`` does not behave as a plain ``nn.Linear`` (None if it does)."""
    cls = type(mod)
    if "forward" in vars(mod):
        return ("its forward is replaced on the instance (e.g. accelerate's hooks); Fp8Linear.forward would drop "
                "what it adds")
    if parametrize.is_parametrized(mod):
        return "its weight is parametrized (torch.nn.utils.parametrize); the parametrization would be lost"
    if cls.forward is not nn.Linear.forward:
        return (f"{cls.__module__}.{cls.__qualname__} defines its own forward, which Fp8Linear.forward would "
                "replace")
    return None


def _weight_readers(model: nn.Module) -> dict[int, str]:
    """The ``nn.Linear`` layers of ``model`` that a parent uses by their weight (``_READS_WEIGHTS``),
    by identity, each with the reason."""
    reasons: dict[int, str] = {}
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        why = next((w for cls, w in _READS_WEIGHTS.items() if isinstance(parent, cls)), None)
        if why is not None:
            for child in parent.children():
                if isinstance(child, nn.Linear):
                    reasons[id(child)] = (f"a layer of {type(parent).__name__} {parent_name or '(the model)'!r}, "
                                          f"which {why}")
    return reasons


def _carry(old: nn.Module, new: Fp8Linear) -> None:
    """Give ``new`` the hooks and train/eval mode of the layer it replaces."""
    new.train(old.training)
    for table in _CARRIED_HOOKS:
        if hasattr(old, table):
            new.__dict__[table] = getattr(old, table)


def _plan(model: nn.Module, skip: tuple[str, ...], custom: bool) -> tuple[dict[int, list[str]], dict[int, str]]:
    """Every ``nn.Linear`` of ``model`` by identity with all its names (a layer used in two places
    has two), and the reason for each one left as it is."""
    names: dict[int, list[str]] = {}
    reasons = _weight_readers(model)
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, nn.Linear) and not isinstance(mod, Fp8Linear):
            names.setdefault(id(mod), []).append(name)
    for key, where in names.items():
        if key in reasons:
            continue
        mod = model.get_submodule(where[0]) if where[0] else model
        hooked = [h for h in _STATE_HOOKS if getattr(mod, h, None)]
        reason = _custom_reason(mod)
        if any(_skipped(n, skip) for n in where):
            reasons[key] = "skip=" + ", ".join(repr(n) for n in where if _skipped(n, skip))
        elif hooked:
            reasons[key] = f"it has state-dict hooks ({', '.join(hooked)}) written for the float layer's state"
        elif reason is not None and not custom:
            reasons[key] = reason + " (quantize_model(..., custom=True) replaces it anyway)"
    return names, reasons


def quantize_model(model: nn.Module, recipe: Recipe | str = W8A8_FP8, skip: tuple[str, ...] | list[str] = ("lm_head",),
                   backend: str = "auto", precision: str = "standard", *,
                   candidates: Sequence[str] | None = None,
                   weight_check: str | None = None, custom: bool = False,
                   dense_fallback: str | None = None) -> QuantizeSummary:
    """Swap every ``nn.Linear`` of ``model`` for an ``Fp8Linear``, in place (weights quantized once).

    All or nothing: every layer is quantized first, and the model is changed only when all of
    them are; a layer that cannot be quantized (a NaN/Inf weight or bias, a weight of another
    dtype) raises, naming it, and leaves the model as it was.

    The model keeps its behaviour: a layer used in several places (``Sequential(l, act, l)``,
    ``a.proj is b.proj``) becomes one ``Fp8Linear`` used in all of them; its forward hooks,
    forward pre-hooks and backward hooks move to the replacement (the same hook tables, so
    their handles still remove them); a layer that does not behave as a plain ``nn.Linear`` is
    left as it is, with the reason in ``summary.reasons``: a projection of
    ``nn.MultiheadAttention`` and the feed-forward layers of ``nn.TransformerEncoderLayer``
    (which read the weight instead of calling the layer), a layer with state-dict hooks, and,
    unless ``custom=True``, a subclass with its own ``forward``, a forward replaced on the
    instance, a parametrized weight. Casting the quantized model (``.half()``,
    ``.to(torch.bfloat16)``, ``.float()``) keeps each ``Fp8Linear``'s codes and scales and casts
    only its bias and explicit ``out_dtype`` (``Fp8Linear._apply``).

    Parameters
    ----------
    model : nn.Module
    recipe : Recipe or str
        Default ``W8A8_FP8``.
    skip : sequence of str
        Module names left as they are: an exact name, a dotted suffix (``"lm_head"`` matches
        ``"model.lm_head"``) or an ``fnmatch`` pattern (``"*.gate"``). A layer used under several
        names is left as it is when any of them matches.
    backend, precision : str
        Passed to every ``Fp8Linear``.
    candidates, weight_check : optional
        Passed to every ``Fp8Linear`` (see ``fp8ref.linear``).
    custom : bool
        Also replace ``nn.Linear`` subclasses with their own ``forward``, layers whose
        ``forward`` is replaced on the instance and parametrized layers (their weight is
        quantized as it is now; what their forward or parametrization added is lost).
    dense_fallback : {None, "auto"}
        None (default): every call runs FP8. ``"auto"``: each layer keeps its original weight and
        runs ``F.linear`` on it in the M buckets where its FP8 call measured slower, decided at
        each bucket's first eager call (``Fp8Linear.from_linear``; outside the W8A8 contract,
        docs/spec.md). The kept weights cost their memory again (``summary.dense_bytes``, in
        ``bytes_after``); ``summary.dense_decisions()`` lists the decisions made so far.

    Returns
    -------
    QuantizeSummary
        Layers replaced, weights quantized, bytes before and after, names, the reason for each
        skipped name, and the dense fallback's kept bytes and decisions.

    Raises
    ------
    ValueError, TypeError
        ``quantize_model: layer 'name' ...``: the first layer that cannot be quantized, and why.

    Examples
    --------
    >>> import torch, fp8ref
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    >>> s = fp8ref.quantize_model(m)
    >>> s.layers, type(m[0]).__name__
    (2, 'Fp8Linear')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model expects an nn.Module, got {type(model).__name__}")
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    check_dense_fallback(dense_fallback)
    recipe = get_recipe(recipe)
    before = _model_bytes(model)
    summary = QuantizeSummary(0, 0, before, before, dense_fallback=dense_fallback)
    names, reasons = _plan(model, skip, custom)
    if any(not n for where in names.values() for n in where):
        raise ValueError("quantize_model needs a model that contains nn.Linear layers; for a lone "
                         "nn.Linear use Fp8Linear.from_linear")
    new: dict[int, tuple[nn.Linear, Fp8Linear]] = {}
    for key, where in names.items():
        if key in reasons:
            for n in where:
                summary.skipped.append(n)
                summary.reasons[n] = reasons[key]
            continue
        mod = model.get_submodule(where[0])
        try:
            q = Fp8Linear.from_linear(mod, recipe=recipe, backend=backend, precision=precision,
                                      candidates=candidates, weight_check=weight_check, dense_fallback=dense_fallback)
        except (TypeError, ValueError) as exc:
            kind = TypeError if isinstance(exc, TypeError) else ValueError
            raise kind(f"quantize_model: layer {where[0]!r} cannot be quantized ({exc}); the model is left "
                       "unchanged") from exc
        _carry(mod, q)
        new[key] = (mod, q)
    # Every layer quantized: only now is the model changed (setattr on a module does not fail).
    for key, (mod, q) in new.items():
        for name in names[key]:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, q)
            summary.quantized.append(name)
        summary.layers += 1
        summary.parameters += mod.weight.numel()
        summary._layers[names[key][0]] = q
        kept = q._buffers.get("dense_weight")
        if kept is not None:
            summary.dense_layers += 1
            summary.dense_bytes += kept.numel() * kept.element_size()
    summary.bytes_after = _model_bytes(model)
    return summary
