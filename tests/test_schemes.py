"""Schemes and recipes: validated on construction, hashable, with stable short strings."""

import pytest
import torch

import fp8ref
from fp8ref import QuantScheme, Recipe, get_recipe


def test_defaults_and_presets():
    s = QuantScheme()
    assert s.format is fp8ref.E4M3FN and s.qmax == 448.0 and s.amax_floor == 1e-12 and s.dynamic
    assert fp8ref.W8A8_FP8.weight.granularity.value == "row"
    assert fp8ref.W8A8_FP8.activation.granularity.value == "row"
    assert fp8ref.FP8_BLOCK.weight.block == (128, 128) and fp8ref.FP8_BLOCK.activation.group_size == 128
    assert fp8ref.W8A8_FP8_ROCM.weight.qmax == 224.0
    assert get_recipe("fp8") is fp8ref.FP8_PER_TENSOR
    assert len({r.short_str() for r in fp8ref.RECIPES.values()}) == len(fp8ref.RECIPES)
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("int8")


def test_hashable_and_equal_by_value():
    assert QuantScheme(granularity="row") == QuantScheme()
    assert len({QuantScheme(), QuantScheme(granularity="tensor"), QuantScheme()}) == 2
    assert QuantScheme(format="e5m2").short_str() == "e5m2-row-dyn"
    assert QuantScheme(granularity="block", block=[2, 3]).block == (2, 3)


@pytest.mark.parametrize("kwargs,match", [
    ({"granularity": "column"}, "granularity"),
    ({"granularity": "group"}, "group_size"),
    ({"granularity": "group", "group_size": 0}, "group_size"),
    ({"group_size": 128}, "only meaningful"),
    ({"granularity": "block", "block": (128,)}, "block"),
    ({"granularity": "block", "block": (0, 128)}, "block"),
    ({"block": (1, 2)}, "only meaningful"),
    ({"amax_floor": -1.0}, "amax_floor"),
    ({"amax_floor": float("nan")}, "amax_floor"),
    ({"qmax": 500.0}, "qmax"),
    ({"qmax": 0.0}, "qmax"),
    ({"qmax": 447.0}, "grid"),
    ({"format": "e4m3fnuz", "qmax": 448.0}, "qmax"),
    ({"scale_dtype": torch.float64}, "scale_dtype"),
    ({"format": "int8"}, "unknown FP8 format"),
])
def test_invalid_schemes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantScheme(**kwargs)


def test_shapes():
    assert QuantScheme().scale_shape(7, 300) == (7, 1)
    assert QuantScheme(granularity="tensor").scale_shape(7, 300) == (1, 1)
    assert QuantScheme(granularity="group", group_size=128).scale_shape(7, 300) == (7, 3)
    assert QuantScheme(granularity="block", block=(128, 128)).scale_shape(300, 300) == (3, 3)


def test_recipe_type_checked():
    with pytest.raises(TypeError):
        Recipe("x", "row", QuantScheme())
