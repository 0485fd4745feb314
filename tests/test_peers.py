"""The peer adapters and ``fp8ref certify``: lazy imports with exact reasons, conventions filled in
and defects not, the matrix's verdicts kept current (the onnxruntime and torchao rows run here, the
others where their packages are installed)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8ref
from fp8ref import Quantized, QuantScheme
from fp8ref.conformance import accumulator_bits
from fp8ref.conformance.strategies import QuantizeProblem, TensorSpec
from fp8ref.peers import Peer, get_peer, peer_names, peers
from fp8ref.peers.certify import certify_peer
from fp8ref.peers.matrix import compare, merge, recorded_verdicts, render, verdicts
from fp8ref.registry import Case, Recipe, get_backend

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "docs" / "certified.md"


def _installed(*mods: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in mods)


def test_peers_listed_without_importing_their_packages():
    names = peer_names()
    assert len(names) == len(set(names)) >= 15
    code = ("import sys, fp8ref.peers as p; p.peers(); "
            "print(sorted(m for m in ('sglang', 'vllm', 'onnxruntime', 'torchao', 'jax', 'compressed_tensors', "
            "'optimum', 'modelopt', 'flax', 'tinygrad', 'quark', 'openvino', 'lmdeploy', 'keras') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for p in peers():
        assert p.project and p.distribution and p.entry and p.notes, p.name
        assert set(p.ops) <= {"quantize", "scaled_mm", "linear"}
        with pytest.raises(KeyError):
            get_backend(p.name)  # certified, never selected by fp8ref.linear


def test_an_absent_package_is_named():
    class Absent(Peer):
        name, project, distribution, entry, notes = "absent", "Nobody", "fp8ref-no-such-dist", "x.y", "-"
        modules = ("fp8ref_no_such_module",)

    assert "fp8ref-no-such-dist is not installed" in Absent().available()
    Absent.distribution = "torch"  # installed, but the module is not
    assert "import fp8ref_no_such_module failed: ModuleNotFoundError" in Absent().available()
    cert = certify_peer(Absent(), "dev", seed=0)
    assert not cert.report.available and verdicts(cert) == {"*": "unavailable"}
    assert "not run here" in render([cert], _header())


def test_conventions_are_filled_in_and_defects_are_not():
    ct = get_peer("compressed-tensors-fp8")
    s = ct.conventions(QuantScheme(), torch.bfloat16)
    assert (s.scale_dtype, s.scale_compute_dtype, s.amax_floor) == (torch.bfloat16, torch.bfloat16, 0.0)
    assert s.zero_scale == torch.finfo(torch.bfloat16).eps and s.subnormal_scales
    p = QuantizeProblem(3, 16, torch.bfloat16, QuantScheme(), TensorSpec())
    assert ct.map_problem(p).scheme == s
    ta = get_peer("torchao-float8").conventions(QuantScheme(amax_floor=0.0), torch.bfloat16)
    assert ta.zero_scale == 1.0 and ta.amax_floor == 0.0  # torchao's scale 0 is a defect: not mapped
    training = get_peer("torchao-float8-training")
    tt = training.conventions(QuantScheme(granularity="tensor"), torch.bfloat16)
    assert (tt.amax_floor, tt.multiply_codes, tt.multiplier_scale) == (1e-12, True, True)  # EPS; stores m
    assert not training.conventions(QuantScheme(pow2_scale=True), torch.float32).multiply_codes
    online = get_peer("sglang-online-w8a8").conventions(QuantScheme(granularity="tensor"), torch.float16)
    assert online.reciprocal_scale and online.multiplier_by_reciprocal and online.multiply_codes  # input_to_float8
    assert not get_peer("sglang-online-w8a8").conventions(QuantScheme(granularity="tensor", dynamic=False),
                                                          torch.float16).reciprocal_scale
    qf = get_peer("vllm-quantfp8-native")
    assert qf.conventions(QuantScheme(), torch.bfloat16).multiply_codes  # per token: x * scale.reciprocal()
    assert not qf.conventions(QuantScheme(granularity="group", group_size=128), torch.bfloat16).multiply_codes
    fx = get_peer("flax-fp8-ops").conventions(QuantScheme(granularity="tensor"), torch.bfloat16)
    assert fx.reciprocal_scale and fx.subnormal_scales and fx.scale_dtype == torch.bfloat16 and fx.amax_floor == 0
    mx = get_peer("jax-mxfp8").conventions(QuantScheme(granularity="group", group_size=32), torch.float32)
    assert mx.pow2_scale and mx.zero_scale == 2.0**-127


class _NaNOnZeroRows(Peer):
    """A fake peer with the torchao defect: no amax floor, scale 0, 0/0 codes."""

    name, project, distribution, entry, notes = "fake-zero-nan", "fake", "torch", "fake", "scale = amax/qmax"
    ops = ("quantize",)

    def supports(self, case):
        s = case.recipe.activation
        ok = s.granularity.value == "row" and s.scale_dtype == torch.float32 and not s.pow2_scale
        return None if ok and s.standard_scale_rule and s.qmax == s.format.max else "row, fp32, plain"

    def quantize(self, x, scheme, scale=None):
        s = x.abs().amax(dim=1, keepdim=True).float() / scheme.qmax
        return Quantized((x.float() / s).clamp(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype), s, scheme)


def test_a_defect_fails_with_a_reproducible_counterexample():
    cert = certify_peer(_NaNOnZeroRows(), "dev", seed=0, contracts=["quantize.codes", "quantize.deterministic"])
    codes = cert.report.result("quantize.codes")
    assert codes.status == "fail" and "NaN code" in codes.message
    want = "fp8ref certify --peer fake-zero-nan --profile dev --seed 0 --only quantize.codes"
    assert codes.reproduce.startswith(want)
    assert cert.report.result("quantize.deterministic").status == "pass"
    assert "codes" in cert.exact_label and cert.exact_samples > 0
    assert "NaN" in cert.non_finite
    text = render([cert], _header())
    assert "**FAILED**" in text and "minimal counterexample" in text
    assert recorded_verdicts(text) == {"fake-zero-nan": verdicts(cert)}
    stale = {"fake-zero-nan": dict(verdicts(cert), **{"quantize.codes": "pass"})}
    (diff,) = compare([cert], stale)
    assert diff.startswith("fake-zero-nan quantize.codes: recorded pass, now fail (")
    assert "NaN code" in diff and want in diff  # the fresh run's message and its reproduction


def _header():
    return {"command": "fp8ref certify", "machine": "test", "versions": "test", "profile": "dev", "seed": 0}


def test_certify_goes_on_past_a_crashed_peer(tmp_path, monkeypatch, capsys):
    """A peer whose certifying process crashes is reported by name and the others still run; a
    whole matrix short of its row is not written, and the exit status says something went wrong."""
    from fp8ref.cli import certify as cli_certify
    from fp8ref.cli import main

    ran = []

    def crash(name, args, bar):
        ran.append(name)
        raise RuntimeError(f"certifying {name} crashed (exit 1): boom")

    monkeypatch.setattr(cli_certify, "_via_subprocess", crash)
    out = tmp_path / "certified.md"
    rc = main(["certify", "--peer", "torchao-float8", "--peer", "onnxruntime-qdq", "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert ran == ["torchao-float8", "onnxruntime-qdq"]
    assert "torchao-float8: CRASHED" in err and "onnxruntime-qdq: CRASHED" in err
    assert "the matrix was not written" in err and not out.exists()


def test_certify_cli_lists_and_rejects_unknown_names():
    from fp8ref.cli import main

    assert main(["certify", "--list"]) == 0
    assert main(["certify", "--peer", "no-such-peer"]) == 2
    assert main(["certify", "--peer", "torchao-float8", "--only", "no.such"]) == 2


@pytest.mark.skipif(not (_installed("onnxruntime", "onnx") and _installed("torchao")),
                    reason="the CI rows need onnxruntime, onnx and torchao (tox installs them)")
def test_ci_rows_of_the_certification_matrix_are_current():
    """Recompute the onnxruntime, onnx-reference and both torchao rows (contracts only) and compare their
    verdicts with docs/certified.md: a changed peer or contract fails here until the matrix is
    regenerated."""
    from fp8ref.cli import main

    rc = main(["certify", "--peer", "onnxruntime-qdq", "--peer", "onnx-reference-qdq", "--peer", "torchao-float8",
               "--peer", "torchao-float8-training", "--in-process", "--no-measure",
               "--check", str(MATRIX), "--known-failures", str(ROOT / "properties" / "known_failures.py")])
    assert rc == 0


def test_matrix_lists_at_least_eight_implementations_each_certified_or_failed():
    text = MATRIX.read_text()
    rec = recorded_verdicts(text)
    ran = {name: v for name, v in rec.items() if v != {"*": "unavailable"}}
    projects = {get_peer(n).project for n in ran}
    assert len(ran) >= 8 and len(projects) >= 8, sorted(ran)
    for name, v in ran.items():
        assert any(s in ("pass", "yes", "fail", "error", "xfail", "no") for s in v.values()), name
    for name in rec:
        assert name in peer_names()


def test_reference_quantizer_is_a_peer_of_itself():
    """The machinery on the always-available reference: a certificate with every quantize contract."""
    class RefPeer(Peer):
        name, project, distribution, entry, notes = "ref", "fp8ref", "torch", "fp8ref.quantize", "the spec"
        ops = ("quantize",)

        def quantize(self, x, scheme, scale=None):
            return fp8ref.quantize(x, scheme, scale)

    cert = certify_peer(RefPeer(), "dev", seed=1, contracts=["quantize.codes", "quantize.bit_exact"])
    assert [r.status for r in cert.report.results] == ["pass", "yes"]
    assert cert.exact_codes == 100 and cert.exact_scales == 100
    assert Case(1, 1, 1, Recipe("q", QuantScheme(), QuantScheme()), op="quantize")  # the case type peers see


def test_every_peer_ledger_entry_names_an_existing_reproduction():
    from fp8ref.cli.conformance import load_known_failures
    from fp8ref.conformance import LOAD_CONTRACT_NAMES
    from fp8ref.peers.loaders import loader_names

    loaders = loader_names()
    for e in load_known_failures(str(ROOT / "properties" / "known_failures.py")):
        path, _, func = e["test"].partition("::")
        assert (ROOT / path).exists(), e["id"]
        assert f"def {func}(" in (ROOT / path).read_text(), e["id"]
        if e.get("property", "").startswith("load."):  # a loader finding: a loader row and a loader contract
            assert e["backend"] in loaders and e["property"] in LOAD_CONTRACT_NAMES, e["id"]
        elif e.get("property"):
            assert e["backend"] in peer_names() and e["upstream"] == (e["link"] or ""), e["id"]


@pytest.mark.skipif(not _installed("sglang"), reason="needs sglang (docs/certified.md, 'Installing the peers')")
def test_sglang_online_w8a8_pre_fix_zero_weights_would_be_caught():
    """sglang#4434: an fp16 checkpoint loaded under ``--quantization w8a8_fp8`` came out with all-zero
    FP8 weights. The installed SGLang's online path (``sglang-online-w8a8``) passes ``quantize.codes``;
    the same adapter with that symptom put back (zero codes for fp16 weights, scales untouched)
    fails it with a counterexample."""
    real = get_peer("sglang-online-w8a8")
    if real.available() is not None:
        pytest.skip(real.available())

    class PreFix4434(type(real)):
        name = "sglang-online-w8a8-pre-4434"

        def quantize(self, x, scheme, scale=None):
            q = super().quantize(x, scheme, scale)
            if x.dtype == torch.float16:
                return Quantized(torch.zeros_like(q.data), q.scale, scheme)
            return q

    ok = certify_peer(real, "ci", seed=0, contracts=["quantize.codes"], measure=False)
    assert ok.report.result("quantize.codes").status == "pass"
    bad = certify_peer(PreFix4434(), "ci", seed=0, contracts=["quantize.codes"], measure=False)
    codes = bad.report.result("quantize.codes")
    assert codes.status == "fail" and "fp16" in codes.counterexample, codes.message


@pytest.mark.skipif(not _installed("openvino", "onnx"),
                    reason="needs openvino (docs/certified.md, 'Installing the peers')")
@pytest.mark.parametrize("name", ["openvino-onnx-qdq", "openvino-convert"])
def test_openvino_rows_dequantize_in_fp32_on_every_machine(name):
    """The adapters pin ``INFERENCE_PRECISION_HINT=f32``; the CPU plugin's default on AVX512-BF16 and
    AMX machines is bf16, which would round the dequantized operand 1.125 * (1 + 2**-10) (11
    significant bits) to 1.125 before the product. With one term (K = 1) the fp32 result is the
    product of the two fp32 dequantized operands, exactly."""
    peer = get_peer(name)
    a = Quantized(torch.tensor([[1.125]]).to(torch.float8_e4m3fn), torch.tensor([[1 + 2**-10]]), QuantScheme())
    b = Quantized(torch.tensor([[1.0]]).to(torch.float8_e4m3fn), torch.tensor([[1.0]]), QuantScheme())
    want = (a.data.float() * a.scale) * (b.data.float() * b.scale)
    assert torch.equal(peer.scaled_mm(a, b, out_dtype=torch.float32), want)


def test_merge_puts_new_rows_in_and_keeps_the_others():
    """``fp8ref certify --peer X --merge docs/certified.md``: X's row, section and verdicts replace
    its old ones or join the page in matrix order; every other peer's stay byte for byte."""
    bad = certify_peer(_NaNOnZeroRows(), "dev", seed=0, contracts=["quantize.codes"], measure=False)

    class Other(_NaNOnZeroRows):
        name = "fake-other"

        def quantize(self, x, scheme, scale=None):
            return fp8ref.quantize(x, scheme, scale)

    other = certify_peer(Other(), "dev", seed=0, contracts=["quantize.codes"], measure=False)
    page = render([bad], _header())
    merged = merge(page, [other], dict(_header(), machine="elsewhere"), ["fake-other", "fake-zero-nan"])
    assert recorded_verdicts(merged) == {"fake-zero-nan": verdicts(bad), "fake-other": verdicts(other)}
    lines = merged.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("| `fake-")]
    assert [lines[i].split("`")[1] for i in rows] == ["fake-other", "fake-zero-nan"]
    for line in page.splitlines()[:-1]:  # the old row and section are kept as they were (not the verdicts line)
        assert line in lines
    assert "Rows merged by `fp8ref certify --merge`" in merged and "elsewhere" in merged and "`fake-other`" in merged
    again = merge(merged, [other], _header(), ["fake-other", "fake-zero-nan"])
    assert again.count("### `fake-other`") == 1 and recorded_verdicts(again) == recorded_verdicts(merged)
    assert again.count("Rows merged by") == 1 and "elsewhere" not in again  # the superseded note goes
    assert "\n\nRows merged by" in again


class _FloatWeightLayer(Peer):
    """A layer that takes the float weight and quantizes both operands itself (``float_weight``): the
    spec's per-tensor quantization and GEMM, fp32 output."""

    name, project, distribution = "fake-float-weight", "test", "torch"
    entry, notes = "spec quantize + scaled_mm inside linear", "the spec's own numerics"
    ops = ("linear",)
    float_weight = True
    recipes = (fp8ref.spec.schemes.FP8_PER_TENSOR,)
    seen: list = []

    def supports(self, case):
        if case.recipe.weight.granularity.value != "tensor" or case.recipe.activation.granularity.value != "tensor":
            return "one scale per tensor"
        return None if case.x_dtype == case.out_dtype == torch.float32 else "fp32 only"

    def prepare_weight(self, w):
        self.seen.append(w)
        return w

    def _weight(self, w, scheme):
        return fp8ref.spec.quant.quantize(w, scheme)

    def linear(self, x, w, bias=None, out_dtype=torch.float32, scheme=None, scale=None):
        qw = self._weight(w, self.recipes[0].weight)
        return fp8ref.spec.gemm.scaled_mm(fp8ref.spec.quant.quantize(x, scheme), qw, bias, out_dtype)


class _HalfAmaxWeightLayer(_FloatWeightLayer):
    """The same layer with its weight scale computed from half the amax: the largest weights clip."""

    name = "fake-float-weight-half-amax"

    def _weight(self, w, scheme):
        s = fp8ref.spec.quant.compute_scale(w, scheme) / 2
        return fp8ref.spec.quant.quantize(w, scheme.with_(dynamic=False), s)


class _Bf16SumLayer(_FloatWeightLayer):
    """The same layer summing the dequantized products along K in a bf16 running sum."""

    name = "fake-float-weight-bf16-sum"

    def linear(self, x, w, bias=None, out_dtype=torch.float32, scheme=None, scale=None):
        a = fp8ref.dequantize(fp8ref.spec.quant.quantize(x, scheme), torch.float32)
        b = fp8ref.dequantize(self._weight(w, self.recipes[0].weight), torch.float32)
        acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        for k in range(x.shape[1]):
            acc = (acc.float() + a[:, k:k + 1] * b[:, k]).to(torch.bfloat16)
        return acc.to(out_dtype)


def test_a_layer_that_quantizes_its_float_weight_is_certified_end_to_end():
    """``Backend.float_weight``: the linear contract hands ``prepare_weight`` the float weight, and
    judges the layer against the bound computed from the spec's quantization (a layer whose weight
    scale clips fails); ``register_backend`` refuses such a layer (fp8ref.linear hands backends
    quantized weights) and the calling contract declines it; certify measures a linear-only peer's outputs (the
    spec's own: all bit-exact) and reads its accumulator through linear."""
    _FloatWeightLayer.seen = []
    ok = certify_peer(_FloatWeightLayer(), "dev", seed=0, contracts=["linear.bound"])
    assert ok.report.result("linear.bound").status == "pass", ok.report.result("linear.bound").message
    assert _FloatWeightLayer.seen and all(not isinstance(w, Quantized) and w.dtype == torch.float32
                                          for w in _FloatWeightLayer.seen)
    assert ok.exact_label == "outputs" and ok.exact_outputs == 100 and ok.exact_samples > 0
    assert ok.expressible.startswith("linear: fp8; x fp32; out fp32; bias")
    assert ok.non_finite == "raises ValueError"  # the spec's quantize refuses NaN
    assert ok.report.accumulator_bits == 35  # the spec's GEMM is exact: the probe's range, read through linear
    assert accumulator_bits(_Bf16SumLayer()) == 8
    bad = certify_peer(_HalfAmaxWeightLayer(), "dev", seed=0, contracts=["linear.bound"], measure=False)
    assert bad.report.result("linear.bound").status == "fail"
    with pytest.raises(ValueError, match="float_weight"):
        fp8ref.register_backend(_FloatWeightLayer())
    layout = certify_peer(_FloatWeightLayer(), "dev", seed=0, contracts=["linear.layout"], measure=False)
    res = layout.report.result("linear.layout")  # the calling contract hands a quantized weight: declined
    assert res.status == "untested" and "takes the float weight" in res.note


@pytest.mark.skipif(not _installed("keras"), reason="needs keras (docs/certified.md, 'Installing the peers')")
def test_keras_rows_leave_torch_state_alone():
    """The keras rows import keras (torch backend) in the process that certifies every peer: torch's
    global state is the same after the import and after a layer call as before."""
    code = """
import torch
from fp8ref.spec.fenv import flushing
def state():
    return (torch.get_default_dtype(), torch.get_num_threads(), torch.get_num_interop_threads(),
            torch.is_grad_enabled(), torch.get_float32_matmul_precision(),
            torch.are_deterministic_algorithms_enabled(), str(torch.get_default_device()), flushing(),
            torch.is_autocast_enabled("cpu"), torch.is_inference_mode_enabled())
before = state()
from fp8ref.peers import get_peer
p = get_peer("keras-dense-float8-bf16")
assert p.available() is None, p.available()
after_import = state()
x, w = torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16()
p.linear(x, p.prepare_weight(w), None, torch.bfloat16, p.recipes[0].activation)
print(before == after_import == state(), before, state())
"""
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.startswith("True"), out


@pytest.mark.slow
@pytest.mark.skipif(not _installed("keras"), reason="needs keras (docs/certified.md, 'Installing the peers')")
def test_keras_torch_rows_of_the_certification_matrix_are_current():
    """Recompute the three keras torch-backend rows (contracts only, each peer in its own process) and
    compare their verdicts with docs/certified.md. Slow: about 1 minute on 2 cores (the jax rows,
    about 3 minutes each, are left to ``fp8ref certify``)."""
    from fp8ref.cli import main

    rc = main(["certify", "--peer", "keras-dense-float8-bf16", "--peer", "keras-dense-float8-fp16",
               "--peer", "keras-dense-float8-fp32", "--no-measure",
               "--check", str(MATRIX), "--known-failures", str(ROOT / "properties" / "known_failures.py")])
    assert rc == 0
