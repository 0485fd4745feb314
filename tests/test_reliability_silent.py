"""Reliability, class 3: no silently wrong result (issue 13).

- NaN/Inf in ``bias`` raises ``ValueError`` naming it, on every backend and entry point (it gave
  NaN columns everywhere but the reference);
- an FP8 weight holding NaN codes (a checkpoint, a foreign quantizer) is refused where it enters:
  ``load_fp8_dynamic``, ``Fp8Linear.from_quantized``, ``fp8ref.linear``;
- autograd: fp8ref computes no gradients. An output computed from inputs that require grad (in grad
  mode) carries a ``grad_fn`` whose backward raises; it is never silently detached (fast backends)
  nor the derivative of the reference quantizer's internals (the reference's torch ops);
- a decision read from the disk cache is re-checked: one outside the requested precision class
  (or otherwise impossible) is ignored with a warning and selected again.
"""

from __future__ import annotations

import json

import pytest
import torch
from reliability_helpers import available, isolated, taking  # noqa: F401 (isolated: an autouse fixture)
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import fp8ref
from fp8ref import select as sel

K, N = 32, 8
NO_GRAD = "fp8ref computes no gradients"


def _taking(name: str) -> fp8ref.Backend:
    return taking(name, fp8ref.Case(M=4, N=N, K=K, recipe=fp8ref.W8A8_FP8, has_bias=True))


def _precision(name: str) -> str:
    return "standard" if name == "auto" else "fast"  # "fast" admits every class


# -- NaN/Inf in the bias ------------------------------------------------------------------------

BAD_BIAS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.mark.parametrize("value", list(BAD_BIAS))
@pytest.mark.parametrize("name", [*available(), "auto"])
def test_non_finite_bias_raises_through_fp8ref_linear(name, value):
    if name != "auto":
        _taking(name)
    bias = torch.zeros(N, dtype=torch.bfloat16)
    bias[3] = BAD_BIAS[value]
    with pytest.raises(ValueError, match=r"bias contains 1 non-finite value\(s\) \(first: .* at index \(3,\)\)"):
        fp8ref.linear(torch.randn(4, K, dtype=torch.bfloat16), torch.randn(N, K), bias, backend=name,
                      precision=_precision(name))


@pytest.mark.parametrize("name", available())
def test_non_finite_bias_raises_through_the_backend_api(name):
    """Called directly (a serving stack holding the backend), not only behind fp8ref.linear."""
    b = _taking(name)
    bias = torch.zeros(N, dtype=torch.bfloat16)
    bias[5] = float("nan")
    x = torch.randn(4, K, dtype=torch.bfloat16)
    qw = b.prepare_weight(fp8ref.quantize(torch.randn(N, K), fp8ref.W8A8_FP8.weight))
    qx = b.quantize(x, fp8ref.W8A8_FP8.activation)
    pattern = r"^bias contains 1 non-finite value\(s\) \(first: nan at index \(5,\)\)"  # the spec's words, everywhere
    with pytest.raises(ValueError, match=pattern):
        b.scaled_mm(qx, qw, bias, torch.bfloat16)
    with pytest.raises(ValueError, match=pattern):
        b.linear(x, qw, bias, torch.bfloat16, fp8ref.W8A8_FP8.activation)


def test_non_finite_bias_in_explain_and_reference_linear():
    bias = torch.zeros(N)
    bias[0] = float("inf")
    for call in (fp8ref.explain, fp8ref.reference_linear):
        with pytest.raises(ValueError, match="bias contains 1 non-finite"):
            call(torch.randn(4, K), torch.randn(N, K), bias)


# -- NaN codes in a quantized weight -------------------------------------------------------------

def _nan_weight() -> fp8ref.Quantized:
    q = fp8ref.quantize(torch.randn(N, K), fp8ref.W8A8_FP8.weight)
    codes = q.data.view(torch.uint8).clone()
    codes[2, 7] = 0x7F  # E4M3FN's NaN (0xFF is the other)
    codes[6, 1] = 0xFF
    return fp8ref.Quantized(codes.view(torch.float8_e4m3fn), q.scale, q.scheme)


@pytest.mark.parametrize("name", [*available(), "auto"])
def test_nan_codes_refused_by_fp8ref_linear(name):
    if name != "auto":
        _taking(name)
    with pytest.raises(ValueError, match=r"w holds 2 e4m3fn code\(s\) that decode to NaN/Inf \(first: 0x7f at "
                                         r"index \(2, 7\)\)"):
        fp8ref.linear(torch.randn(4, K), _nan_weight(), backend=name, precision=_precision(name))


def test_nan_codes_and_bad_scales_refused_by_fp8linear():
    with pytest.raises(ValueError, match="qw holds 2 e4m3fn code"):
        fp8ref.Fp8Linear.from_quantized(_nan_weight())
    q = fp8ref.quantize(torch.randn(N, K), fp8ref.W8A8_FP8.weight)
    scale = q.scale.clone()
    scale[4, 0] = float("inf")
    with pytest.raises(ValueError, match=r"qw has scale inf at index \(4, 0\)"):
        fp8ref.Fp8Linear.from_quantized(fp8ref.Quantized(q.data, scale, q.scheme))


def test_checkpoint_with_nan_codes_is_refused(tmp_path):
    """The reported case: a checkpoint whose weight holds 0x7F loaded and served NaN."""
    model = nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(N, 4))
    fp8ref.quantize_model(model, skip=(), backend="reference")
    good = tmp_path / "good.safetensors"
    fp8ref.save_fp8_dynamic(model, good)
    with safe_open(str(good), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    codes = tensors["2.weight"].view(torch.uint8).clone()
    codes[1, 3] = 0x7F
    tensors["2.weight"] = codes.view(torch.float8_e4m3fn)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    fresh = nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(N, 4))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(fp8ref.CheckpointError, match=r"2\.weight holds 1 e4m3fn code\(s\) that decode to NaN/Inf "
                                                     r"\(first: 0x7f at index \(1, 3\)\)"):
        fp8ref.load_fp8_dynamic(fresh, bad)
    assert all(type(m) is not fp8ref.Fp8Linear for m in fresh.modules())  # nothing half loaded
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


# -- Autograd ------------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["x", "w", "bias"])
@pytest.mark.parametrize("name", [*available(), "auto"])
def test_gradient_asked_of_fp8ref_raises_on_backward(name, what):
    if name != "auto":
        _taking(name)
    x, w, bias = (torch.randn(*s, dtype=torch.bfloat16) for s in ((4, K), (N, K), (N,)))
    {"x": x, "w": w, "bias": bias}[what].requires_grad_(True)
    y = fp8ref.linear(x, w, bias, backend=name, precision=_precision(name))
    assert y.requires_grad, "a silently detached output: loss.backward() would skip this layer"
    with pytest.raises(RuntimeError, match=f"{NO_GRAD} \\({what} of an fp8ref linear requires grad\\)"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match=NO_GRAD):
        torch.autograd.grad(y.sum(), [t for t in (x, w, bias) if t.requires_grad])
    with torch.no_grad():  # inference: no graph, no error
        y0 = fp8ref.linear(x, w, bias, backend=name, precision=_precision(name))
    assert not y0.requires_grad and torch.equal(y0, y.detach())


def test_reference_records_no_gradient_of_its_internals():
    """The reference backend's torch ops used to record a graph through the quantizer (a wrong
    gradient: the codes' cast differentiated as the identity); now the backward raises."""
    x = torch.randn(2, 3, K, requires_grad=True)
    for y in (fp8ref.linear(x, torch.randn(N, K), backend="reference"), fp8ref.reference_linear(x, torch.randn(N, K))):
        assert y.shape == (2, 3, N) and y.requires_grad
        with pytest.raises(RuntimeError, match=NO_GRAD):
            y.sum().backward()
        assert x.grad is None


def test_fp8linear_in_a_model_run_without_no_grad():
    """A model run without torch.no_grad() (its embedding's weight requires grad) still infers;
    backpropagating through an Fp8Linear is what raises."""
    model = nn.Sequential(nn.Embedding(16, K), nn.Linear(K, N))
    fp8ref.quantize_model(model, skip=(), backend="reference")
    out = model(torch.randint(0, 16, (2, 5)))
    assert out.shape == (2, 5, N) and bool(torch.isfinite(out).all())
    with pytest.raises(RuntimeError, match=f"{NO_GRAD} \\(x of an fp8ref linear requires grad\\)"):
        out.sum().backward()


# -- A cached decision outside the requested precision class ------------------------------------

CASE = fp8ref.Case(M=4, N=N, K=K, recipe=fp8ref.W8A8_FP8, x_dtype=torch.float32, out_dtype=torch.float32)


def _tamper(key: str, **changes) -> None:
    path = sel.cache_file()
    data = json.loads(path.read_text())
    data["entries"][key].update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("changes, why", [
    ({"chosen": "torch-fast", "ranking": ["torch-fast", "reference"]}, "class fast, outside precision='standard'"),
    ({"precision": "fast"}, "made for precision='fast'"),
    ({"chosen": "reference"}, "is not first of its ranking"),
    ({"chosen": "gone", "ranking": ["gone", "reference"]}, "'gone' is not registered"),
    ({"ranking": []}, "is not first of its ranking"),
])
def test_disk_decision_is_rechecked(changes, why):
    # torch-fast is a candidate (of class fast, so never chosen at "standard"): a file naming it is
    # refused for its class; a backend outside the candidates is refused before (test_cache_trust.py).
    cands = ["cpu-fp32", "torch-fast"]
    first = sel.select(CASE, candidates=cands)
    assert first.source == "probe" and first.chosen == "cpu-fp32"
    _tamper(first.key, **changes)
    sel.clear_cache()  # a new process: memory empty, the file is what it finds
    with pytest.warns(UserWarning, match=f"ignoring the cached decision .*{why}"):
        d = sel.select(CASE, candidates=cands)
    assert d.source == "probe" and d.chosen == "cpu-fp32"
    sel.clear_cache()
    assert sel.select(CASE, candidates=cands).source == "disk"  # rebuilt and stored again


# -- NaN/Inf in x: scanned by fp8ref.linear, or by a backend that declares it does --------------

class PassesNaN(fp8ref.Backend):
    """Quantizes without looking at the values (as sgl-kernel's per-token kernel does): NaN in x
    flows through to the output unless someone scans x."""

    name = "t-passes-nan"
    accumulation = fp8ref.Accumulation.FP32

    def quantize(self, x, scheme):
        amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=scheme.amax_floor)
        s = amax / scheme.qmax
        q = (x.float() / s).clamp(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype)
        return fp8ref.Quantized(q, s, scheme)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = a.dequantize(torch.float32) @ b.dequantize(torch.float32).T
        return (y if bias is None else y + bias.float()).to(out_dtype)


class ClaimsButPasses(PassesNaN):
    name = "t-claims"
    rejects_non_finite = True  # a false claim: the probe must catch it


@pytest.fixture()
def fake():
    made = [fp8ref.register_backend(b, replace=True) for b in (PassesNaN(), ClaimsButPasses())]
    yield {b.name: b for b in made}
    for b in made:
        fp8ref.unregister_backend(b.name)


@pytest.mark.parametrize("name", ["t-passes-nan", "auto"])
def test_non_finite_x_is_caught_for_a_backend_that_passes_it(fake, monkeypatch, name):
    monkeypatch.setenv(sel.ENV_CANDIDATES, "t-passes-nan")
    w = torch.randn(N, K)
    fp8ref.linear(torch.randn(4, K), w, backend=name)  # the dispatch is cached: the hot path next
    x = torch.randn(2, 2, K)
    x[1, 0, 3] = float("inf")
    with pytest.raises(ValueError, match=r"^x contains 1 non-finite value\(s\) \(first: inf at index \(1, 0, 3\)\)"):
        fp8ref.linear(x, w, backend=name)
    bias = torch.zeros(N)
    bias[2] = float("nan")
    with pytest.raises(ValueError, match=r"^bias contains 1 non-finite"):
        fp8ref.linear(torch.randn(4, K), w, bias, backend=name)


@pytest.mark.parametrize("name", available())
def test_backends_that_declare_it_reject_non_finite_x(name):
    """The shipped backends' declaration (fp8ref.linear skips its own scan for them on the hot path),
    checked on both of the calls fp8ref.linear makes, with the caller's index in the message."""
    b = _taking(name)
    if not b.rejects_non_finite:
        pytest.skip(f"{name} does not declare rejects_non_finite")
    qw = b.prepare_weight(fp8ref.quantize(torch.randn(N, K), fp8ref.W8A8_FP8.weight))
    x = torch.randn(4, K, dtype=torch.bfloat16)
    x[2, 9] = float("nan")
    for call in (lambda: b.quantize(x, fp8ref.W8A8_FP8.activation),
                 lambda: b.linear(x, qw, None, torch.bfloat16, fp8ref.W8A8_FP8.activation)):
        with pytest.raises(ValueError, match=r"x contains 1 non-finite value\(s\) \(first: nan at index \(2, 9\)\)"):
            call()
    fp8ref.linear(torch.randn(4, K, dtype=torch.bfloat16), torch.randn(N, K), backend=name, precision="fast")
    x3 = torch.randn(2, 2, K, dtype=torch.bfloat16)
    x3[1, 1, 0] = float("-inf")  # the hot path: the backend raises, the message keeps x's own index
    with pytest.raises(ValueError, match=r"^x contains 1 non-finite value\(s\) \(first: -inf at index \(1, 1, 0\)\)"):
        fp8ref.linear(x3, torch.randn(N, K), backend=name, precision="fast")


def test_probe_refuses_a_false_claim(fake):
    res = sel.probe(fake["t-claims"], fp8ref.Case(M=4, N=N, K=K, recipe=fp8ref.W8A8_FP8))
    assert not res.compliant and "declares rejects_non_finite, but linear() with NaN in x" in res.detail
    assert sel.probe(fake["t-passes-nan"], fp8ref.Case(M=4, N=N, K=K, recipe=fp8ref.W8A8_FP8)).compliant
