"""Hostile checkpoint bytes given to safetensors and to fp8ref: fp8ref refuses everything
safetensors refuses (``CheckpointError`` naming the file, the tensor and the rule, never a raw
RecursionError / OverflowError / TypeError / AttributeError) and adds its own refusals on top."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors
import torch
from safetensors.torch import save_file
from torch import nn

import fp8ref
from fp8ref import checkpoint


def _raw(header: dict | bytes, data: bytes = b"", n: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if n is None else n) + h + data


def _f32(shape, begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def _entry(name: bytes, dtype: bytes, shape: bytes, begin: int, end: int) -> bytes:
    return b'"%s":{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]}' % (name, dtype, shape, begin, end)


# name: (bytes, the rule fp8ref's message states). safetensors refuses every one of them.
REFUSED_BY_BOTH = {
    "float dimension [8.9]": (_raw({"t": _f32([8.9], 0, 32)}, bytes(32)), r"not a safetensors JSON header.*8\.9"),
    "shape given as the string '48'": (_raw({"t": _f32("48", 0, 128)}, bytes(128)), r"string \\?\"48\\?\""),
    "shape given as an object": (_raw({"t": _f32({"4": 1, "8": 2}, 0, 128)}, bytes(128)), r"invalid type: map"),
    "a hole between tensors": (_raw({"a": _f32([2], 0, 8), "b": _f32([2], 12, 20)}, bytes(20)),
                               r"tensor 'b': .*without holes or overlaps"),
    "trailing bytes": (_raw({"a": _f32([2], 0, 8)}, bytes(12)), r"bytes after the last tensor"),
    "two tensors aliasing the same bytes": (_raw({"a": _f32([2], 0, 8), "b": _f32([2], 0, 8)}, bytes(8)),
                                            r"tensor '[ab]': .*two tensors sharing bytes"),
    "overlapping offsets": (_raw({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, bytes(12)),
                            r"tensor 'b': .*without holes or overlaps"),
    "a key named twice, bytes not covered": (
        _raw(b"{" + _entry(b"a", b"F32", b"[2]", 0, 8) + b"," + _entry(b"a", b"F32", b"[1]", 0, 4) + b"}", bytes(8)),
        r"bytes after the last tensor, a hole, or a key named twice"),
    "a nesting bomb": (_raw(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), r"recursion limit"),
    "an Infinity dimension": (_raw(b"{" + _entry(b"a", b"F32", b"[Infinity]", 0, 8) + b"}", bytes(8)),
                              r"not a safetensors JSON header"),
    "a dimension past int64": (_raw(b"{" + _entry(b"a", b"F32", b"[99999999999999999999]", 0, 8) + b"}", bytes(8)),
                               r"expected usize"),
    "an element count that overflows": (
        _raw(b"{" + _entry(b"a", b"F32", b"[4294967296,4294967296,4]", 0, 0) + b"}"), r"element count overflows"),
    "a negative dimension": (_raw(b"{" + _entry(b"a", b"F32", b"[-2]", 0, 8) + b"}", bytes(8)), r"-2"),
    "a boolean dimension": (_raw(b"{" + _entry(b"a", b"F32", b"[true]", 0, 4) + b"}", bytes(4)), r"boolean"),
    "an unknown dtype": (_raw(b"{" + _entry(b"a", b"F31", b"[1]", 0, 4) + b"}", bytes(4)), r"F31"),
    "metadata that is not a string": (_raw({"__metadata__": {"x": 1}}), r"expected a string"),
    "a header that is a list": (_raw(b"[1]"), r"not a safetensors JSON header"),
    "a header that is not UTF-8": (_raw(b'{"\xff":1}'), r"not UTF-8"),
    "a header length past the cap": (struct.pack("<Q", 100_000_001) + b"{}",
                                     r"exceeds safetensors' cap of 100,000,000"),
    "a header length past the file": (struct.pack("<Q", 50) + b"{}", r"header length 50 does not fit"),
    "fewer than 8 bytes": (b"\x01", r"fewer than the 8"),
}


@pytest.mark.parametrize("case", list(REFUSED_BY_BOTH))
def test_what_safetensors_refuses_fp8ref_refuses_naming_file_tensor_and_rule(tmp_path, case):
    data, rule = REFUSED_BY_BOTH[case]
    with pytest.raises(safetensors.SafetensorError):
        safetensors.deserialize(data)
    p = tmp_path / "hostile.safetensors"
    p.write_bytes(data)
    model = nn.Sequential(nn.Linear(2, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fp8ref.CheckpointError, match=rf"^{p}: not a readable safetensors file \(.*{rule}"):
        fp8ref.load_fp8_dynamic(model, p)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model[0]) is nn.Linear


def test_a_key_named_twice_is_refused_even_where_safetensors_keeps_the_last(tmp_path):
    """Two entries for ``a`` over the same 8 bytes (F32 [2], then I8 [8]): the bytes tile, so
    safetensors loads the last; a reader that keeps the first sees another tensor."""
    data = _raw(b"{" + _entry(b"a", b"F32", b"[2]", 0, 8) + b"," + _entry(b"a", b"I8", b"[8]", 0, 8) + b"}", bytes(8))
    assert [(k, v["dtype"]) for k, v in safetensors.deserialize(data)] == [("a", "I8")]
    p = tmp_path / "dup.safetensors"
    p.write_bytes(data)
    with pytest.raises(fp8ref.CheckpointError, match=rf"^{p}: .*the key 'a' is named twice"):
        fp8ref.load_fp8_dynamic(nn.Sequential(nn.Linear(2, 2)), p)


def test_a_metadata_key_named_twice_is_refused(tmp_path):
    """Two ``quantization_config`` entries: safetensors keeps the last, fp8ref refuses the file."""
    data = _raw(b'{"__metadata__":{"quantization_config":"{}","quantization_config":"[]"}}')
    assert safetensors.deserialize(data) == []
    p = tmp_path / "dup.safetensors"
    p.write_bytes(data)
    with pytest.raises(fp8ref.CheckpointError, match=r"'quantization_config' is named twice in __metadata__"):
        fp8ref.load_fp8_dynamic(nn.Sequential(nn.Linear(2, 2)), p)


def _quantized_file(tmp_path, metadata: dict | None = None, **extra: torch.Tensor):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8))
    fp8ref.quantize_model(m, skip=(), backend="reference")
    tensors = {k: v.contiguous() for k, v in m.state_dict().items()} | extra
    p = tmp_path / "q.safetensors"
    save_file(tensors, str(p), metadata=metadata)
    return p


def _cfg(**group) -> dict:
    cfg = checkpoint.compressed_tensors_config([])
    cfg["config_groups"]["group_0"].update(group)
    return cfg


@pytest.mark.parametrize("config, rule", [
    ('"a string"', r"\(the whole value\) is \"a string\", expected an object"),
    ("[1, 2]", r"\(the whole value\) is \[1, 2\], expected an object"),
    ('{"config_groups": []}', r"config_groups is \[\], expected an object"),
    ('{"config_groups": {"g": "x"}}', r"config_groups\.g is \"x\", expected an object"),
    ('{"ignore": "lm_head"}', r"ignore is \"lm_head\", expected a list"),
    ('{"ignore": [3]}', r"ignore\[0\] is 3, expected a string"),
    (json.dumps(_cfg(weights=[8])), r"config_groups\.group_0\.weights is \[8\], expected an object or null"),
    (json.dumps(_cfg(weights={"type": "float", "num_bits": 8.0, "strategy": "channel"})),
     r"group_0\.weights\.num_bits is 8\.0, expected an integer"),
    (json.dumps(_cfg(weights={"type": "float", "num_bits": True, "strategy": "channel"})),
     r"group_0\.weights\.num_bits is true, expected an integer"),
    (json.dumps(_cfg(input_activations={"strategy": "token", "dynamic": "yes"})),
     r"input_activations\.dynamic is \"yes\", expected true/false"),
    ("[" * 100_000 + "]" * 100_000, r"metadata is not JSON \(nested too deeply\)"),
    ("{not json", r"metadata is not JSON"),
])
def test_a_wrongly_typed_quantization_config_is_refused_naming_the_field(tmp_path, config, rule):
    p = _quantized_file(tmp_path, {"format": "pt", "quantization_config": config})
    with pytest.raises(fp8ref.CheckpointError, match=rf"^{p}: quantization_config .*{rule}"):
        fp8ref.load_fp8_dynamic(nn.Sequential(nn.Linear(16, 8)), p)


def test_e8m0_tensors_load_and_e8m0_scales_are_refused_by_name(tmp_path):
    """F8_E8M0 is a safetensors dtype (torch.float8_e8m0fnu): a model buffer of that dtype loads
    bit-exactly; as the weight_scale of an FP8_DYNAMIC layer it is refused, by name."""
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    e8m0 = codes.view(torch.float8_e8m0fnu)
    p = _quantized_file(tmp_path, extra=e8m0)
    assert [v["dtype"] for k, v in safetensors.deserialize(p.read_bytes()) if k == "extra"] == ["F8_E8M0"]
    model = nn.Sequential(nn.Linear(16, 8))
    model.register_buffer("extra", torch.zeros(7, dtype=torch.float8_e8m0fnu))
    assert fp8ref.load_fp8_dynamic(model, p) == ["0"]
    assert torch.equal(model.extra.view(torch.uint8), codes)

    scale = torch.ones(8, 1).to(torch.float8_e8m0fnu)
    bad = _quantized_file(tmp_path, **{"0.weight_scale": scale})
    with pytest.raises(fp8ref.CheckpointError, match=r"^0\.weight_scale is F8_E8M0 \(power-of-two MX block scales\)"):
        fp8ref.load_fp8_dynamic(nn.Sequential(nn.Linear(16, 8)), bad)


def test_a_dtype_fp8ref_cannot_hold_is_refused_by_name(tmp_path):
    data = _raw(b"{" + _entry(b"packed", b"F4", b"[4]", 0, 2) + b"}", bytes(2))
    try:
        safetensors.deserialize(data)
    except safetensors.SafetensorError:
        pytest.skip(f"safetensors {safetensors.__version__} has no F4 dtype")
    p = tmp_path / "f4.safetensors"
    p.write_bytes(data)
    with pytest.raises(fp8ref.CheckpointError, match=rf"^{p}: .*'packed' has dtype F4, which fp8ref does not load"):
        fp8ref.load_fp8_dynamic(nn.Sequential(nn.Linear(2, 2)), p)
