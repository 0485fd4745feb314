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
then ``os.replace``, so a crash never leaves a half-written checkpoint under the final name; a
write that fails (a full disk) raises ``OSError`` naming the path and the cause.

Reading does not memory-map the file (safetensors' ``safe_open`` does): another program that
rewrites a mapped file in place makes a read of it fault (SIGBUS) and kills the interpreter.
``_Reader`` reads the whole file with plain reads and hands the bytes to the ``safetensors``
package (``safetensors.deserialize``), so a file loads exactly when safetensors accepts it: its
header rules (shapes lists of non-negative integers, known dtypes, the tensors tiling the data
region in order with no hole, overlap, shared bytes or trailing byte, the 100 MB header cap, a
nesting limit) are the ones applied, and its refusals are raised as ``CheckpointError`` naming
the file, the tensor and the rule. On top, fp8ref refuses a key named twice (safetensors keeps
the last entry when the bytes still tile), dtypes it cannot hold, a wrongly typed
``quantization_config`` and E8M0 scales. The peak memory of a load is twice the file's size (its
bytes, then each tensor's copy). A file whose size or modification time changed by the end of the
load raises ``CheckpointError`` instead of loading a mix of two files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ._io import atomic_write
from ._safetensors_reader import CheckpointError, _Reader, _safetensors
from ._version import __version__
from .nn import Fp8Linear
from .spec.checks import check_codes, check_finite
from .spec.formats import E4M3FN
from .spec.quant import Quantized
from .spec.schemes import FP8_DYNAMIC, Granularity, Recipe
from .surgery import _carry, _weight_readers

__all__ = ["save_fp8_dynamic", "load_fp8_dynamic", "compressed_tensors_config", "CheckpointError"]

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    st = _safetensors("save_fp8_dynamic")
    try:
        atomic_write(path, lambda tmp: st.torch.save_file(tensors, tmp, metadata=metadata))
    except st.SafetensorError as exc:  # e.g. a full disk: safetensors' message names no path
        raise OSError(f"cannot write the checkpoint {path}: {exc}") from exc
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot write the checkpoint {path}: {exc.strerror or exc}") from exc


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
    _atomic_save(tensors, Path(path), {"format": "pt", "quantization_config": json.dumps(cfg),
                                       "producer": f"fp8ref {__version__}"})
    return cfg


def _expect(value, types: tuple[type, ...], where: str, path) -> None:
    """Refuse a ``quantization_config`` field of the wrong JSON type (``True`` is not a number)."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join({dict: "an object", list: "a list", str: "a string", int: "an integer",
                             bool: "true/false", type(None): "null"}[t] for t in types)
        raise CheckpointError(f"{path}: quantization_config {where} is {json.dumps(value)[:80]}, expected {names}")


#: The fields of a config group's ``weights`` / ``input_activations`` that fp8ref reads, and their types.
_QUANT_FIELDS = {"type": (str,), "num_bits": (int,), "strategy": (str,), "dynamic": (bool,)}


def _check_config(meta: dict[str, str] | None, path) -> None:
    """Refuse a ``quantization_config`` that is not JSON, holds a field fp8ref reads in another
    JSON type, or describes another layout than FP8_DYNAMIC."""
    if not meta or "quantization_config" not in meta:
        return
    try:
        cfg = json.loads(meta["quantization_config"])
    except (ValueError, RecursionError) as exc:
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise CheckpointError(f"{path}: quantization_config metadata is not JSON ({detail})") from None
    _expect(cfg, (dict,), "(the whole value)", path)
    groups = cfg.get("config_groups", {})
    _expect(groups, (dict,), "config_groups", path)
    if "ignore" in cfg:
        _expect(cfg["ignore"], (list,), "ignore", path)
        for i, item in enumerate(cfg["ignore"]):
            _expect(item, (str,), f"ignore[{i}]", path)
    for gname, g in groups.items():
        _expect(g, (dict,), f"config_groups.{gname}", path)
        for part in ("weights", "input_activations"):
            _expect(g.get(part), (dict, type(None)), f"config_groups.{gname}.{part}", path)
            for key, types in _QUANT_FIELDS.items():
                if key in (g.get(part) or {}):
                    _expect(g[part][key], types, f"config_groups.{gname}.{part}.{key}", path)
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
    becomes an ``Fp8Linear`` holding those codes and ``<m>.weight_scale`` (one ``Fp8Linear`` under
    every name of a layer the model uses twice, with the layer's hooks); every other tensor is
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
        is not the model's, an FP8 weight for a layer that attention reads by its weight, a layer
        used under two names with two different tensors; naming the file: one that safetensors
        refuses (named with its tensor and the rule: shapes not lists of non-negative integers,
        holes, overlaps, shared or trailing bytes, the 100 MB header cap, a nesting limit), a key
        named twice, a dtype fp8ref cannot hold, a ``quantization_config`` that is not JSON or holds
        a wrongly typed field, E8M0 weight scales.

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
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; load_fp8_dynamic reads one .safetensors file")
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_fp8_dynamic expects an nn.Module, got {type(model).__name__}")
    on_meta = next((n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                    if t.device.type == "meta"), None)
    if on_meta is not None:
        raise ValueError(f"load_fp8_dynamic: the model's {on_meta} is on the meta device (built under "
                         "torch.device('meta')); fp8ref checks and keeps real tensors: materialise the model "
                         "first, e.g. model.to_empty(device='cpu')")
    uses: dict[int, tuple[nn.Module, list[str]]] = {}  # a layer used under several names is one layer
    for n, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, (nn.Linear, Fp8Linear)):
            uses.setdefault(id(m), (m, []))[1].append(n)
    if any(not n for _, names in uses.values() for n in names):
        raise ValueError("load_fp8_dynamic needs a model containing linear layers, not a lone layer")
    readers = _weight_readers(model)
    new: dict[str, Fp8Linear] = {}
    consumed: set[str] = set()
    with _Reader(path) as f:
        _check_config(f.metadata(), path)
        keys = f.keys()
        for key, (mod, names) in uses.items():
            layer = _read_layer(f, keys, names[0], mod, backend, precision, strict, consumed)
            if layer is None:
                continue
            if key in readers:
                raise CheckpointError(f"{names[0]}.weight is F8_E4M3 but layer {names[0]!r} is {readers[key]}: an "
                                      "Fp8Linear there would be handed FP8 codes")
            _carry(mod, layer)
            for alias in names[1:]:
                _check_alias(f, keys, names[0], alias, consumed)
            new.update(dict.fromkeys(names, layer))
        rest = {k: f.get_tensor(k) for k in keys - consumed}
        f.check_unchanged()
    _check_rest(model, path, rest, set(new), consumed, strict)
    # Every tensor checked: only now is the model changed (all or nothing).
    for name, layer in new.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    model.load_state_dict(rest, strict=False)
    return list(new)


def _check_alias(f: _Reader, keys: set[str], name: str, alias: str, consumed: set[str]) -> None:
    """The model uses one layer under ``name`` and ``alias``: the file's tensors for ``alias`` (a
    copy, as ``save_fp8_dynamic`` stores tied tensors) must be byte-equal to those of ``name``."""
    for suffix in ("weight", "weight_scale", "bias"):
        a, b = f"{name}.{suffix}", f"{alias}.{suffix}"
        if b not in keys:
            continue
        ta, tb = (f.get_tensor(a) if a in keys else None), f.get_tensor(b)
        if (ta is None or ta.dtype != tb.dtype or ta.shape != tb.shape
                or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))):
            raise CheckpointError(f"the model uses one layer as {name!r} and {alias!r}, but the checkpoint's {b} "
                                  f"differs from {a}")
        consumed.add(b)


def _read_layer(f: _Reader, keys: set[str], name: str, mod: nn.Module, backend: str, precision: str, strict: bool,
                consumed: set[str]) -> Fp8Linear | None:
    """The ``Fp8Linear`` for layer ``name`` from the open file ``f`` (None if the file holds no FP8
    weight for it), every tensor checked; the keys it used are added to ``consumed``."""
    p = f"{name}."
    wk, sk, ik, bk = p + "weight", p + "weight_scale", p + "input_scale", p + "bias"
    w_is_fp8 = wk in keys and f.dtype_name(wk) == "F8_E4M3"
    if not w_is_fp8 and sk not in keys:
        if isinstance(mod, Fp8Linear) and wk in keys:
            raise CheckpointError(f"{wk} is {f.dtype_name(wk)}, expected F8_E4M3 for the "
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
    if f.dtype_name(sk) == "F8_E8M0":
        raise CheckpointError(f"{sk} is F8_E8M0 (power-of-two MX block scales): the FP8_DYNAMIC layout stores "
                              "one fp32/bf16/fp16 scale per output channel, and fp8ref loads no E8M0 scales")
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
    was = mod if isinstance(mod, Fp8Linear) else None  # an Fp8Linear keeps its own settings
    return Fp8Linear.from_quantized(qw, None if bias is None else bias.to(device), recipe=recipe,
                                    backend=backend if was is None else was.backend,
                                    precision=precision if was is None else was.precision,
                                    candidates=None if was is None else was.candidates,
                                    weight_check=None if was is None else was.weight_check)


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
