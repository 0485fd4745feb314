"""The peer adapters and ``fp8ref certify``: lazy imports with exact reasons, conventions filled in
and defects not, the matrix's verdicts kept current (the onnxruntime and torchao rows run here, the
others where their packages are installed)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8ref
from fp8ref import Quantized, QuantScheme
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
            "'optimum', 'modelopt', 'flax', 'tinygrad', 'quark', 'openvino', 'lmdeploy') if m in sys.modules))")
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


def test_certify_cli_lists_and_rejects_unknown_names():
    from fp8ref.cli import main

    assert main(["certify", "--list"]) == 0
    assert main(["certify", "--peer", "no-such-peer"]) == 2
    assert main(["certify", "--peer", "torchao-float8", "--only", "no.such"]) == 2


@pytest.mark.skipif(not (_installed("onnxruntime", "onnx") and _installed("torchao")),
                    reason="the CI rows need onnxruntime, onnx and torchao (tox installs them)")
def test_ci_rows_of_the_certification_matrix_are_current():
    """Recompute the onnxruntime, onnx-reference and torchao rows (contracts only) and compare their
    verdicts with docs/certified.md: a changed peer or contract fails here until the matrix is
    regenerated."""
    from fp8ref.cli import main

    rc = main(["certify", "--peer", "onnxruntime-qdq", "--peer", "onnx-reference-qdq", "--peer", "torchao-float8",
               "--in-process", "--no-measure",
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

    for e in load_known_failures(str(ROOT / "properties" / "known_failures.py")):
        path, _, func = e["test"].partition("::")
        assert (ROOT / path).exists(), e["id"]
        assert f"def {func}(" in (ROOT / path).read_text(), e["id"]
        if e.get("property"):
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
