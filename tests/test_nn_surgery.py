"""quantize_model keeps the model: shared layers, Linear subclasses, attention, hooks, casts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import fp8ref

pytestmark = pytest.mark.usefixtures("isolated_selection")


def _q(model: nn.Module, **kw) -> fp8ref.QuantizeSummary:
    return fp8ref.quantize_model(model, skip=kw.pop("skip", ()), backend="reference", **kw)


def _expected(layer: fp8ref.Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    return fp8ref.linear(x, layer.quantized_weight(), layer.bias, recipe=layer.recipe, backend="reference")


def test_a_layer_used_twice_in_a_sequential_is_one_fp8linear():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    m = nn.Sequential(lin, nn.ReLU(), lin)
    s = _q(m)
    assert type(m[0]) is fp8ref.Fp8Linear and m[0] is m[2]
    assert (s.layers, s.parameters, s.quantized) == (1, 256, ["0", "2"])
    x = torch.randn(3, 16)
    assert torch.equal(m(x), _expected(m[2], torch.relu(_expected(m[0], x))))


def test_a_layer_shared_by_two_modules_is_one_fp8linear():
    torch.manual_seed(0)
    a, b = nn.Module(), nn.Module()
    a.proj = b.proj = nn.Linear(8, 4)
    root = nn.Module()
    root.a, root.b = a, b
    s = _q(root)
    assert type(root.a.proj) is fp8ref.Fp8Linear and root.a.proj is root.b.proj
    assert s.layers == 1 and sorted(s.quantized) == ["a.proj", "b.proj"]


def test_a_shared_layer_skipped_under_one_name_is_skipped_under_all():
    lin = nn.Linear(8, 8)
    m = nn.Sequential(lin, nn.ReLU(), lin)
    s = _q(m, skip=("2",))
    assert m[0] is lin and m[2] is lin and s.layers == 0
    assert s.skipped == ["0", "2"] and s.reasons["0"] == "skip='2'"


class Scaled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_subclass_with_its_own_forward_is_skipped_unless_custom():
    torch.manual_seed(0)
    m = nn.Sequential(Scaled(8, 8), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    first = m[0](x)
    s = _q(m)
    assert type(m[0]) is Scaled and torch.equal(m[0](x), first)
    assert s.quantized == ["1"] and s.skipped == ["0"]
    assert "test_nn_surgery.Scaled defines its own forward" in s.reasons["0"] and "custom=True" in s.reasons["0"]
    s = _q(m, custom=True)
    assert type(m[0]) is fp8ref.Fp8Linear and s.quantized == ["0"]


def test_a_subclass_without_its_own_forward_is_a_linear():
    m = nn.Sequential(nn.modules.linear.NonDynamicallyQuantizableLinear(8, 8))
    assert _q(m).quantized == ["0"]


def test_a_forward_replaced_on_the_instance_and_a_parametrization_are_custom():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    plain = m[0].forward
    m[0].forward = lambda x: plain(x) + 1  # what accelerate's add_hook_to_module does
    parametrize.register_parametrization(m[1], "weight", nn.Identity())
    s = _q(m)
    assert s.layers == 0
    assert "forward is replaced on the instance" in s.reasons["0"]
    assert "parametrized" in s.reasons["1"]
    assert _q(m, custom=True).layers == 2


def test_multihead_attention_projections_are_skipped_and_the_layer_still_runs():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    m = nn.ModuleDict({"attn": mha, "head": nn.Linear(16, 4)})
    x = torch.randn(2, 3, 16)
    before, _ = mha(x, x, x)
    for custom in (False, True):
        s = _q(m, custom=custom)
        assert type(mha.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
        assert s.skipped == ["attn.out_proj"]
        assert "MultiheadAttention 'attn', which reads its projections' weights directly" in s.reasons["attn.out_proj"]
        assert torch.equal(mha(x, x, x)[0], before)
    assert type(m["head"]) is fp8ref.Fp8Linear


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_transformer_encoder_layer_keeps_running(mode):
    """In eval mode without grad the layer's fast path reads linear1/linear2's weights itself: a
    swapped layer made it fail with a dtype error naming no layer."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    getattr(layer, mode)()
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        before = layer(x)
    s = _q(layer)
    assert s.layers == 0 and sorted(s.skipped) == ["linear1", "linear2", "self_attn.out_proj"]
    assert "TransformerEncoderLayer '(the model)', which reads linear1's" in s.reasons["linear1"]
    with torch.inference_mode():
        assert torch.equal(layer(x), before)


def test_forward_hooks_and_pre_hooks_move_to_the_replacement():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    m = nn.Sequential(lin, nn.ReLU(), lin)
    calls = []
    pre = lin.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
    post = lin.register_forward_hook(lambda mod, args, out: calls.append(type(mod).__name__) or out + 1)
    kw = lin.register_forward_hook(lambda mod, args, kwargs, out: out, with_kwargs=True, always_call=True)
    _q(m)
    q = m[0]
    x = torch.randn(2, 8)
    expect = _expected(q, torch.relu(_expected(q, x * 0.5) + 1) * 0.5) + 1
    assert torch.equal(m(x), expect) and calls == ["Fp8Linear", "Fp8Linear"]
    for handle in (pre, post, kw):  # the handles the user holds still remove the hooks
        handle.remove()
    assert not (q._forward_hooks or q._forward_pre_hooks or q._forward_hooks_with_kwargs
                or q._forward_hooks_always_called)
    assert torch.equal(m(x), _expected(q, torch.relu(_expected(q, x))))


def test_a_layer_with_state_dict_hooks_is_skipped_with_the_reason():
    m = nn.Sequential(nn.Linear(8, 8))
    m[0].register_state_dict_post_hook(lambda mod, sd, prefix, local_metadata: None)
    s = _q(m)
    assert s.layers == 0 and "state-dict hooks (_state_dict_hooks)" in s.reasons["0"]


def test_eval_mode_is_kept():
    m = nn.Sequential(nn.Linear(8, 8)).eval()
    _q(m)
    assert not m[0].training


@pytest.mark.parametrize("cast, dtype", [(lambda m: m.half(), torch.float16),
                                          (lambda m: m.to(torch.bfloat16), torch.bfloat16),
                                          (lambda m: m.float(), torch.float32),
                                          (lambda m: m.to("cpu", torch.float16), torch.float16)])
def test_a_cast_of_the_quantized_model_keeps_codes_and_scales(cast, dtype):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
    _q(m)
    m[2].out_dtype = torch.float32
    codes = [m[i].weight.clone() for i in (0, 2)]
    scales = [m[i].weight_scale.clone() for i in (0, 2)]
    bias = m[0].bias.detach().clone()
    cast(m)
    for i, c, s in zip((0, 2), codes, scales, strict=True):
        assert m[i].weight.dtype == torch.float8_e4m3fn and torch.equal(m[i].weight.view(torch.uint8),
                                                                         c.view(torch.uint8))
        assert m[i].weight_scale.dtype == torch.float32 and torch.equal(m[i].weight_scale, s)
    assert m[0].bias.dtype == dtype and torch.equal(m[0].bias, bias.to(dtype))
    assert m[2].out_dtype == dtype  # an explicit output dtype follows the cast
    x = torch.randn(3, 16, dtype=dtype)
    y = m(x)
    assert y.dtype == dtype
    h = torch.relu(fp8ref.linear(x, m[0].quantized_weight(), m[0].bias, backend="reference"))
    assert torch.equal(y, fp8ref.linear(h, m[2].quantized_weight(), None, backend="reference", out_dtype=dtype))


def test_load_fp8_dynamic_keeps_a_shared_layer_shared_and_its_hooks(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    m = nn.Sequential(lin, nn.ReLU(), lin)
    _q(m)
    p = tmp_path / "shared.safetensors"
    fp8ref.save_fp8_dynamic(m, p)
    fresh_lin = nn.Linear(8, 8)
    fresh = nn.Sequential(fresh_lin, nn.ReLU(), fresh_lin)
    calls = []
    fresh_lin.register_forward_hook(lambda mod, args, out: calls.append(1))
    assert fp8ref.load_fp8_dynamic(fresh, p, backend="reference") == ["0", "2"]
    assert type(fresh[0]) is fp8ref.Fp8Linear and fresh[0] is fresh[2]
    x = torch.randn(2, 8)
    assert torch.equal(fresh(x), m(x)) and calls == [1, 1]


def test_load_fp8_dynamic_refuses_a_shared_layer_with_two_different_weights(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    _q(m)
    p = tmp_path / "two.safetensors"
    fp8ref.save_fp8_dynamic(m, p)
    lin = nn.Linear(8, 8)
    with pytest.raises(fp8ref.CheckpointError, match=r"one layer as '0' and '2', but the checkpoint's 2\.weight "
                                                     r"differs from 0\.weight"):
        fp8ref.load_fp8_dynamic(nn.Sequential(lin, nn.ReLU(), lin), p)


def test_load_fp8_dynamic_refuses_an_fp8_weight_for_attention_projections(tmp_path):
    torch.manual_seed(0)
    src = nn.ModuleDict({"attn": nn.ModuleDict({"out_proj": nn.Linear(16, 16)})})
    _q(src)
    p = tmp_path / "attn.safetensors"
    fp8ref.save_fp8_dynamic(src, p)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(16, 2, bias=False)})
    with pytest.raises(fp8ref.CheckpointError, match=r"attn\.out_proj\.weight is F8_E4M3 but layer 'attn\.out_proj' "
                                                     r"is a layer of MultiheadAttention 'attn'"):
        fp8ref.load_fp8_dynamic(model, p, strict=False)
    assert type(model["attn"].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
