"""FP8 checkpoints in the compressed-tensors FP8_DYNAMIC layout, via safetensors (no pickle).

Layout (what Neural Magic's "-FP8-dynamic" checkpoints hold, and vLLM / SGLang read):

* ``<m>.weight``        F8_E4M3 ``[N, K]``: the FP8 codes of each quantized linear ``m``;
* ``<m>.weight_scale``  ``[N, 1]``: per-output-channel *dequantization* scales (fp32 here;
  bf16/fp16 are accepted on load and widened exactly);
* no ``<m>.input_scale``: activations are quantized dynamically, per token;
* every other tensor (biases, embeddings, norms, layers left unquantized) as it is.

The safetensors header metadata holds ``format: pt`` and ``quantization_config``: the JSON that
compressed-tensors writes into ``config.json`` (``quant_method: compressed-tensors``, format
``float-quantized``, weights ``channel``/static, input activations ``token``/dynamic, and the
``ignore`` list). Files are written atomically: a temporary file in the same directory, fsync,
then ``os.replace``, so a crash never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ._io import atomic_write
from .api import check_codes, check_finite
from .nn import Fp8Linear
from .spec.formats import E4M3FN
from .spec.quant import Quantized
from .spec.schemes import FP8_DYNAMIC, Granularity, Recipe

__all__ = ["save_fp8_dynamic", "load_fp8_dynamic", "compressed_tensors_config", "CheckpointError"]

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, mis-shaped or wrongly typed (the message names it)."""


def compressed_tensors_config(ignore: list[str]) -> dict:
    """The ``quantization_config`` compressed-tensors writes for the FP8_DYNAMIC preset.

    Examples
    --------
    >>> from fp8ref.checkpoint import compressed_tensors_config
    >>> compressed_tensors_config(["lm_head"])["config_groups"]["group_0"]["weights"]["strategy"]
    'channel'
    """
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                            "symmetric": True, "observer": "minmax"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                      "symmetric": True, "observer": None},
                "output_activations": None,
            }
        },
        "ignore": sorted(ignore),
    }


def _check_layout(name: str, recipe: Recipe) -> None:
    w, a = recipe.weight, recipe.activation
    ok = (w.format == E4M3FN and w.granularity is Granularity.ROW and w.qmax == E4M3FN.max
          and a.format == E4M3FN and a.granularity is Granularity.ROW and a.dynamic)
    if not ok:
        raise ValueError(f"layer {name!r} uses recipe {recipe.short_str()}; the FP8_DYNAMIC layout holds "
                         "e4m3fn per-channel weights with dynamic per-token e4m3fn activations")


def _safetensors(what: str):
    """The ``safetensors`` package (a core dependency), or an ImportError that says how to get it
    (an environment installed before it was one, or with ``--no-deps``)."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        raise ModuleNotFoundError(f"{what} reads and writes .safetensors files and needs the safetensors package, "
                                  "a dependency of fp8ref that this environment lacks: pip install "
                                  "'safetensors>=0.4' (or reinstall fp8ref without --no-deps)",
                                  name="safetensors") from exc
    return safetensors


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    save_file = _safetensors("save_fp8_dynamic").torch.save_file
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def save_fp8_dynamic(model: nn.Module, path: str | os.PathLike) -> dict:
    """Save a model quantized with ``Fp8Linear`` layers in the FP8_DYNAMIC layout.

    Parameters
    ----------
    model : nn.Module
        Typically after ``fp8ref.quantize_model``; its ``nn.Linear`` layers that were not
        quantized go to the ``ignore`` list and are saved as they are.
    path : str or PathLike
        The ``.safetensors`` file (written atomically).

    Returns
    -------
    dict
        The ``quantization_config`` (also stored in the file's metadata).

    Examples
    --------
    >>> import torch, fp8ref, tempfile, os
    >>> m = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> _ = fp8ref.quantize_model(m, backend="reference")
    >>> p = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fp8ref.save_fp8_dynamic(m, p)["format"]
    'float-quantized'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_fp8_dynamic expects an nn.Module, got {type(model).__name__}")
    ignore = []
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8Linear):
            _check_layout(name, mod.recipe)
        elif isinstance(mod, nn.Linear):
            ignore.append(name)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for k, v in model.state_dict().items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"state_dict entry {k!r} is a {type(v).__name__}, not a tensor: safetensors "
                            "stores tensors only")
        v = v.detach().to("cpu").contiguous()
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset())
        if ptr in seen:  # tied weights: safetensors refuses shared storage, so store a copy
            v = v.clone()
        seen.add((v.untyped_storage().data_ptr(), v.storage_offset()))
        tensors[k] = v
    cfg = compressed_tensors_config(ignore)
    from . import __version__

    _atomic_save(tensors, Path(path), {"format": "pt", "quantization_config": json.dumps(cfg),
                                       "producer": f"fp8ref {__version__}"})
    return cfg


def _check_config(meta: dict[str, str] | None, path) -> None:
    if not meta or "quantization_config" not in meta:
        return
    try:
        cfg = json.loads(meta["quantization_config"])
        groups = cfg.get("config_groups", {})
    except (ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable quantization_config metadata: {exc}") from None
    for gname, g in groups.items():
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") != "channel":
            raise CheckpointError(f"{path}: config group {gname!r} has weights {w}; FP8_DYNAMIC needs 8-bit float "
                                  "channel-wise weights")
        if a and (a.get("strategy") != "token" or not a.get("dynamic")):
            raise CheckpointError(f"{path}: config group {gname!r} has input activations {a}; fp8ref loads "
                                  "dynamic per-token activations only")


def load_fp8_dynamic(model: nn.Module, path: str | os.PathLike, *, backend: str = "auto",
                     precision: str = "standard", strict: bool = True) -> list[str]:
    """Load an FP8_DYNAMIC checkpoint into ``model``, in place.

    Every ``nn.Linear`` (or ``Fp8Linear``) ``m`` whose ``<m>.weight`` is F8_E4M3 in the file
    becomes an ``Fp8Linear`` holding those codes and ``<m>.weight_scale``; every other tensor is
    loaded as usual. ``model`` is the unquantized architecture (e.g. built from its config) or
    an already quantized one.

    Parameters
    ----------
    model : nn.Module
    path : str or PathLike
    backend, precision : str
        For the new ``Fp8Linear`` layers.
    strict : bool
        Raise on tensors of the model missing from the file, or of the file unused by the model.

    Returns
    -------
    list of str
        Names of the layers loaded as ``Fp8Linear``.

    Raises
    ------
    CheckpointError
        Naming the tensor: an FP8 weight without ``weight_scale`` (or the reverse), a scale of the
        wrong shape (not ``[N, 1]``), dtype (not fp32/bf16/fp16) or value (non-finite or <= 0), a
        weight of the wrong shape or dtype or holding NaN codes (0x7F, 0xFF), a bias of the wrong
        shape or dtype or holding NaN/Inf, a static ``input_scale``, any other tensor whose shape
        is not the model's; naming the file: one that is not a readable safetensors file.

    Notes
    -----
    All or nothing: every tensor is read and checked before the model is changed, so a bad
    checkpoint raises and leaves ``model`` as it was.

    Examples
    --------
    >>> import torch, fp8ref, tempfile, os
    >>> m = torch.nn.Sequential(torch.nn.Linear(32, 16))
    >>> _ = fp8ref.quantize_model(torch.nn.Sequential(m), backend="reference")
    >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> _ = fp8ref.save_fp8_dynamic(m, p)
    >>> fp8ref.load_fp8_dynamic(torch.nn.Sequential(torch.nn.Linear(32, 16)), p)
    ['0']
    """
    st = _safetensors("load_fp8_dynamic")
    SafetensorError, safe_open = st.SafetensorError, st.safe_open
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_fp8_dynamic expects an nn.Module, got {type(model).__name__}")
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, Fp8Linear))]
    if any(not n for n, _ in layers):
        raise ValueError("load_fp8_dynamic needs a model containing linear layers, not a lone layer")
    new: dict[str, Fp8Linear] = {}
    consumed: set[str] = set()
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            _check_config(f.metadata(), path)
            keys = set(f.keys())
            for name, mod in layers:
                layer = _read_layer(f, keys, name, mod, backend, precision, strict, consumed)
                if layer is not None:
                    new[name] = layer
            rest = {k: f.get_tensor(k) for k in keys - consumed}
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    _check_rest(model, path, rest, set(new), consumed, strict)
    # Every tensor checked: only now is the model changed (all or nothing).
    for name, layer in new.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    model.load_state_dict(rest, strict=False)
    return list(new)


def _read_layer(f, keys: set[str], name: str, mod: nn.Module, backend: str, precision: str, strict: bool,
                consumed: set[str]) -> Fp8Linear | None:
    """The ``Fp8Linear`` for layer ``name`` from the open file ``f`` (None if the file holds no FP8
    weight for it), every tensor checked; the keys it used are added to ``consumed``."""
    p = f"{name}."
    wk, sk, ik, bk = p + "weight", p + "weight_scale", p + "input_scale", p + "bias"
    w_is_fp8 = wk in keys and f.get_slice(wk).get_dtype() == "F8_E4M3"
    if not w_is_fp8 and sk not in keys:
        if isinstance(mod, Fp8Linear) and wk in keys:
            raise CheckpointError(f"{wk} is {f.get_slice(wk).get_dtype()}, expected F8_E4M3 for the "
                                  f"quantized layer {name!r}")
        return None
    if wk not in keys:
        raise CheckpointError(f"{sk} is present but the weight {wk} is missing")
    w = f.get_tensor(wk)
    if w.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{wk} has dtype {w.dtype} but {sk} is present: an FP8_DYNAMIC weight must "
                              "be F8_E4M3 (torch.float8_e4m3fn)")
    N, K = mod.out_features, mod.in_features
    if tuple(w.shape) != (N, K):
        raise CheckpointError(f"{wk} has shape {tuple(w.shape)}, layer {name!r} needs [{N}, {K}]")
    if sk not in keys:
        raise CheckpointError(f"{wk} is F8_E4M3 but its scale {sk} is missing")
    s = f.get_tensor(sk)
    if s.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{sk} has dtype {s.dtype}; expected one of "
                              f"{[str(d) for d in _SCALE_DTYPES]}")
    if tuple(s.shape) != (N, 1):
        raise CheckpointError(f"{sk} has shape {tuple(s.shape)}, expected [{N}, 1] (one scale per "
                              "output channel)")
    s = s.to(torch.float32)  # bf16 and fp16 values are exact in fp32
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        bad = int((~torch.isfinite(s) | (s <= 0)).nonzero()[0, 0])
        raise CheckpointError(f"{sk} row {bad} holds {float(s[bad, 0])}: scales must be finite and > 0")
    if ik in keys:
        raise CheckpointError(f"{ik} is present: static activation scales are not FP8_DYNAMIC "
                              "(fp8ref.linear quantizes activations per token, dynamically)")
    recipe = mod.recipe if isinstance(mod, Fp8Linear) else FP8_DYNAMIC
    _check_layout(name, recipe)
    qw = Quantized(w, s, recipe.weight)
    try:
        check_codes(qw, wk)  # NaN codes (0x7F, 0xFF) would serve NaN outputs
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    bias = None
    if mod.bias is not None:
        if bk not in keys:
            if strict:
                raise CheckpointError(f"layer {name!r} has a bias but {bk} is missing")
            bias = mod.bias.detach()
        else:
            bias = f.get_tensor(bk)
            if not bias.is_floating_point() or bias.element_size() == 1:
                raise CheckpointError(f"{bk} has dtype {bias.dtype}; a bias must be fp32, bf16 or fp16")
            if tuple(bias.shape) != (N,):
                raise CheckpointError(f"{bk} has shape {tuple(bias.shape)}, layer {name!r} needs [{N}]")
            try:
                check_finite(bias, bk)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            bias = bias.to(mod.bias.dtype)
            consumed.add(bk)
    elif bk in keys and strict:
        raise CheckpointError(f"{bk} is in the checkpoint but layer {name!r} has no bias")
    consumed.update((wk, sk))
    device = mod.weight.device
    qw = Quantized(w.to(device), s.to(device), recipe.weight)
    return Fp8Linear.from_quantized(qw, None if bias is None else bias.to(device), recipe=recipe,
                                    backend=mod.backend if isinstance(mod, Fp8Linear) else backend,
                                    precision=mod.precision if isinstance(mod, Fp8Linear) else precision)


def _check_rest(model: nn.Module, path: Path, rest: dict[str, torch.Tensor], replaced: set[str],
                consumed: set[str], strict: bool) -> None:
    """What ``load_state_dict(rest)`` would refuse, found before the model is changed: a tensor of
    another shape than the model's, and (``strict``) tensors missing from the file or unused."""
    sd = model.state_dict()
    for k, v in rest.items():
        if k in sd and tuple(v.shape) != tuple(sd[k].shape):
            raise CheckpointError(f"{path}: {k} has shape {tuple(v.shape)}, the model's is {tuple(sd[k].shape)}")
    if not strict:
        return
    owned = tuple(f"{n}." for n in replaced)
    missing = [k for k in sd if k not in rest and k not in consumed and not k.startswith(owned)]
    unexpected = [k for k in rest if k not in sd]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {missing}, "
                              f"unexpected {unexpected}")
