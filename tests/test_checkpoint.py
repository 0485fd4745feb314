"""FP8_DYNAMIC checkpoints: round trip, layout, metadata, clear errors, atomic writes."""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import fp8ref
from fp8ref import checkpoint
from fp8ref import select as sel

L = sys.modules["fp8ref.api"]


@pytest.fixture(autouse=True)
def iso(tmp_path, monkeypatch):
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path / "cache"))
    sel.clear_cache()
    yield
    sel.clear_cache()
    L.clear_weight_cache()


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(32, 64, dtype=dtype)
        self.proj = nn.Linear(64, 96, dtype=dtype)
        self.out = nn.Linear(96, 64, bias=False, dtype=dtype)
        self.lm_head = nn.Linear(64, 32, bias=False, dtype=dtype)
        self.lm_head.weight = self.embed.weight  # tied, as many LMs are

    def forward(self, ids):
        return self.lm_head(self.out(torch.relu(self.proj(self.embed(ids)))))


def _quantized_tiny(dtype=torch.bfloat16):
    torch.manual_seed(0)
    m = Tiny(dtype)
    fp8ref.quantize_model(m, backend="reference")
    return m


def test_round_trip(tmp_path):
    m = _quantized_tiny()
    path = tmp_path / "model.safetensors"
    cfg = fp8ref.save_fp8_dynamic(m, path)
    assert cfg["ignore"] == ["lm_head"] and cfg["quant_method"] == "compressed-tensors"
    fresh = Tiny(torch.bfloat16)
    loaded = fp8ref.load_fp8_dynamic(fresh, path, backend="reference")
    assert loaded == ["proj", "out"]
    for name in loaded:
        a, b = m.get_submodule(name), fresh.get_submodule(name)
        assert isinstance(b, fp8ref.Fp8Linear)
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(a.weight_scale, b.weight_scale)
    assert torch.equal(fresh.embed.weight, m.embed.weight)
    ids = torch.randint(0, 32, (2, 5))
    assert torch.equal(fresh(ids), m(ids))
    # loading into an already quantized model works too
    fp8ref.load_fp8_dynamic(_quantized_tiny(), path)


def test_layout_and_metadata(tmp_path):
    m = _quantized_tiny()
    path = tmp_path / "model.safetensors"
    fp8ref.save_fp8_dynamic(m, path)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])  # safetensors: a JSON header then raw bytes, no pickle
    assert header["proj.weight"]["dtype"] == "F8_E4M3" and header["proj.weight"]["shape"] == [96, 64]
    assert header["proj.weight_scale"]["shape"] == [96, 1] and header["proj.weight_scale"]["dtype"] == "F32"
    assert header["proj.bias"]["dtype"] == "BF16"
    assert header["lm_head.weight"]["dtype"] == "BF16" and "lm_head.weight_scale" not in header
    assert not any(k.endswith("input_scale") for k in header)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    cfg = json.loads(meta["quantization_config"])
    g = cfg["config_groups"]["group_0"]
    assert g["weights"]["strategy"] == "channel" and g["input_activations"]["strategy"] == "token"
    assert g["input_activations"]["dynamic"] is True and meta["format"] == "pt"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def _tamper(tmp_path, **changes):
    """Save the quantized Tiny, then rewrite the file with some tensors replaced or removed."""
    src = tmp_path / "good.safetensors"
    fp8ref.save_fp8_dynamic(_quantized_tiny(), src)
    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    return bad


@pytest.mark.parametrize("changes, match", [
    ({"proj__weight_scale": None}, r"proj\.weight_scale is missing"),
    ({"proj__weight_scale": torch.ones(96)}, r"proj\.weight_scale has shape \(96,\), expected \[96, 1\]"),
    ({"proj__weight_scale": torch.ones(95, 1)}, r"proj\.weight_scale has shape \(95, 1\)"),
    ({"proj__weight_scale": torch.ones(96, 1, dtype=torch.int32)}, r"proj\.weight_scale has dtype torch\.int32"),
    ({"proj__weight_scale": torch.zeros(96, 1)}, r"proj\.weight_scale row 0 holds 0\.0"),
    ({"proj__weight": None}, r"proj\.weight_scale is present but the weight proj\.weight is missing"),
    ({"proj__weight": torch.zeros(96, 64, dtype=torch.bfloat16)}, r"proj\.weight has dtype torch\.bfloat16"),
    ({"proj__weight": torch.zeros(64, 96, dtype=torch.float8_e4m3fn)}, r"proj\.weight has shape \(64, 96\)"),
    ({"proj__input_scale": torch.ones(1)}, r"proj\.input_scale is present"),
    ({"out__weight_scale": None}, r"out\.weight is F8_E4M3 but its scale out\.weight_scale is missing"),
    ({"embed__weight": None}, r"missing \['embed\.weight'"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, changes, match):
    bad = _tamper(tmp_path, **changes)
    with pytest.raises(fp8ref.CheckpointError, match=match):
        fp8ref.load_fp8_dynamic(Tiny(torch.bfloat16), bad)


def test_bf16_scales_accepted_exactly(tmp_path):
    m = _quantized_tiny()
    s16 = m.proj.weight_scale.to(torch.bfloat16)
    bad = _tamper(tmp_path, proj__weight_scale=s16)
    fresh = Tiny(torch.bfloat16)
    fp8ref.load_fp8_dynamic(fresh, bad)
    assert fresh.proj.weight_scale.dtype == torch.float32
    assert torch.equal(fresh.proj.weight_scale, s16.float())


def test_wrong_recipe_refused_on_save(tmp_path):
    torch.manual_seed(0)
    m = Tiny()
    fp8ref.quantize_model(m, recipe=fp8ref.FP8_BLOCK, backend="reference")
    with pytest.raises(ValueError, match="layer 'proj' uses recipe fp8_block"):
        fp8ref.save_fp8_dynamic(m, tmp_path / "x.safetensors")


def test_atomic_write_leaves_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    fp8ref.save_fp8_dynamic(_quantized_tiny(), path)
    before = path.read_bytes()
    import safetensors.torch as st

    def exploding_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a header")
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", exploding_save)
    with pytest.raises(OSError, match="disk full"):
        fp8ref.save_fp8_dynamic(_quantized_tiny(), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_config_helper():
    cfg = checkpoint.compressed_tensors_config(["b", "a"])
    assert cfg["ignore"] == ["a", "b"] and cfg["format"] == "float-quantized"


def test_missing_safetensors_says_what_to_install(tmp_path, monkeypatch):
    m = nn.Sequential(nn.Linear(16, 8))
    fp8ref.quantize_model(m, skip=())
    p = tmp_path / "m.safetensors"
    fp8ref.save_fp8_dynamic(m, p)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # what an environment without it imports
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'safetensors>=0.4'"):
        fp8ref.save_fp8_dynamic(m, tmp_path / "other.safetensors")
    assert not (tmp_path / "other.safetensors").exists()
    # Loading parses with safetensors too (its rules, from bytes fp8ref read: no memory map).
    with pytest.raises(ModuleNotFoundError, match=r"^load_fp8_dynamic .*pip install 'safetensors>=0.4'"):
        fp8ref.load_fp8_dynamic(nn.Sequential(nn.Linear(16, 8)), p)
