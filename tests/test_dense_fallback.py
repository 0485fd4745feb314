"""The dense fallback (``dense_fallback="auto"``): off by default, exact ``F.linear`` on the kept
weight where a bucket is decided dense, decisions per bucket and dtype, reported, kept out of the
state dict. Decisions are injected (``decide_dense(..., dense=)``) or timed on a fake clock: no
test depends on the machine's speed."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8ref
from fp8ref import select as sel
from fp8ref.select import dense

pytestmark = pytest.mark.usefixtures("isolated_selection")


def _linear(n=24, k=40, dtype=torch.bfloat16, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, dtype=dtype)


def _fp8(layer: fp8ref.Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    return fp8ref.linear(x, layer.quantized_weight(), layer.bias, recipe=layer.recipe, backend="reference")


@pytest.mark.parametrize("shape", [(1, 40), (3, 40), (2, 65, 40), (130, 40)])
def test_off_by_default_changes_nothing(shape):
    lin = _linear()
    plain = fp8ref.Fp8Linear.from_linear(lin, backend="reference")
    off = fp8ref.Fp8Linear.from_linear(lin, backend="reference", dense_fallback=None)
    x = torch.randn(shape, dtype=torch.bfloat16)
    assert torch.equal(plain(x), _fp8(plain, x)) and torch.equal(off(x), plain(x))
    for q in (plain, off):
        assert q.dense_fallback is None and "dense_weight" not in dict(q.named_buffers())
        assert sorted(q.state_dict()) == ["bias", "weight", "weight_scale"]
        assert "dense" not in q.extra_repr()
    s = fp8ref.quantize_model(nn.Sequential(_linear()), skip=(), backend="reference")
    assert (s.dense_fallback, s.dense_layers, s.dense_bytes) == (None, 0, 0) and "dense" not in str(s)


def test_a_bucket_decided_dense_computes_f_linear_on_the_original_weight():
    lin = _linear()
    q = fp8ref.Fp8Linear.from_linear(lin, backend="reference", dense_fallback="auto")
    assert q.dense_weight.dtype == torch.bfloat16 and torch.equal(q.dense_weight, lin.weight)
    assert q.dense_weight.data_ptr() != lin.weight.data_ptr()  # a copy: the nn.Linear may change or go
    q.decide_dense(128, dense=True)
    q.decide_dense(64, dense=False)
    for M, is_dense in ((65, True), (128, True), (64, False), (33, False)):
        x = torch.randn(M, 40, dtype=torch.bfloat16)
        want = F.linear(x, lin.weight, lin.bias) if is_dense else _fp8(q, x)
        assert torch.equal(q(x), want), M
    x3 = torch.randn(2, 50, 40, dtype=torch.bfloat16)  # M = 100: bucket 128, leading dims kept
    assert torch.equal(q(x3), F.linear(x3, lin.weight, lin.bias))
    assert q.plan(x3) is None  # the dense path takes the call: no FP8 plan runs it


def test_decisions_are_per_bucket_and_dtype():
    lin = _linear(dtype=torch.float32)
    q = fp8ref.Fp8Linear.from_linear(lin, backend="reference", dense_fallback="auto")
    q.decide_dense(16, dense=True)
    x = torch.randn(9, 40)
    assert torch.equal(q(x), F.linear(x, lin.weight, lin.bias))
    xb = x.to(torch.bfloat16)  # the kept weight is float32: a bf16 x runs FP8 whatever its bucket says
    assert torch.equal(q(xb), _fp8(q, xb))
    with pytest.raises(ValueError, match="kept weight's dtype"):
        q.decide_dense(16, torch.bfloat16, dense=True)
    q.to(torch.bfloat16)  # now the kept weight is bf16: its buckets are decided anew
    q.decide_dense(16, dense=False)
    assert torch.equal(q(xb), _fp8(q, xb))
    assert [(dt, c.bucket, c.dense, c.source) for dt, c in q.dense_decisions()] == [
        (torch.bfloat16, 16, False, "forced"), (torch.float32, 16, True, "forced")]


def test_an_undecided_bucket_is_decided_once_by_the_timing(monkeypatch):
    q = fp8ref.Fp8Linear.from_linear(_linear(), backend="reference", dense_fallback="auto")
    seen = []

    def fake_decide(key, M, fp8, dense_call, device="cpu"):
        a, b = fp8(), dense_call()
        seen.append((key, M, tuple(a.shape), tuple(b.shape), torch.equal(a, b)))
        return dense.DenseChoice(bucket=sel.m_bucket(M), dense=True, ratio=0.5, rows=dense.timed_rows(M))

    monkeypatch.setattr(dense, "decide", fake_decide)
    x = torch.randn(100, 40, dtype=torch.bfloat16)
    y = q(x)
    q(x[:70])
    assert len(seen) == 1  # the bucket is decided at its first call only
    key, M, fp8_shape, dense_shape, same = seen[0]
    assert (M, fp8_shape, dense_shape, same) == (100, (128, 24), (128, 24), False)  # both sides at the bucket's rows
    assert "N=24" in key and "K=40" in key and "Mb=128" in key and "x=bfloat16" in key
    assert torch.equal(y, F.linear(x, q.dense_weight, q.bias))
    assert "dense at bfloat16 M<=128: dense (fp8/dense speed 0.50)" in q.extra_repr()


@pytest.mark.parametrize("fp8_s, dense_s, is_dense", [(2.0, 1.0, True), (1.0, 2.0, False), (1.0, 1.0, False)])
def test_decide_times_both_sides_and_remembers(monkeypatch, fp8_s, dense_s, is_dense):
    now = [0.0]
    monkeypatch.setattr(dense, "clock", lambda: now[0])
    calls = {"fp8": 0, "dense": 0}

    def side(name, s):
        def run():
            calls[name] += 1
            now[0] += s
        return run

    c = dense.decide("k", 100, side("fp8", fp8_s), side("dense", dense_s))
    assert (c.dense, c.bucket, c.rows, c.source) == (is_dense, 128, 128, "timed")
    assert c.ratio == c.ratio_min == dense_s / fp8_s and dense.MIN_ROUNDS <= c.rounds <= dense.MAX_ROUNDS
    n = dict(calls)
    again = dense.decide("k", 120, side("fp8", fp8_s), side("dense", dense_s))
    assert calls == n and again.source == "memory" and again.dense == is_dense  # a second layer: no timing
    sel.clear_cache()
    dense.decide("k", 100, side("fp8", fp8_s), side("dense", dense_s))
    assert calls != n  # clear_cache forgets it


def test_clear_cache_makes_a_layer_decide_again_but_keeps_forced_decisions(monkeypatch):
    q = fp8ref.Fp8Linear.from_linear(_linear(), backend="reference", dense_fallback="auto")
    q.decide_dense(4, dense=True)
    monkeypatch.setattr(dense, "decide", lambda key, M, f, d, device="cpu": dense.DenseChoice(
        bucket=sel.m_bucket(M), dense=False, ratio=2.0))
    q(torch.randn(8, 40, dtype=torch.bfloat16))
    sel.clear_cache()
    monkeypatch.setattr(dense, "decide", lambda *a, **k: pytest.fail("decided again"))
    q(torch.randn(4, 40, dtype=torch.bfloat16))  # forced: kept
    monkeypatch.setattr(dense, "decide", lambda key, M, f, d, device="cpu": dense.DenseChoice(
        bucket=sel.m_bucket(M), dense=True, ratio=0.5))
    x = torch.randn(8, 40, dtype=torch.bfloat16)
    assert torch.equal(q(x), F.linear(x, q.dense_weight, q.bias))  # timed: decided again


def test_quantize_model_reports_the_kept_weights_and_decisions():
    m = nn.Sequential(_linear(24, 40), nn.ReLU(), _linear(40, 24, seed=1))
    off = fp8ref.quantize_model(nn.Sequential(_linear(24, 40), nn.ReLU(), _linear(40, 24, seed=1)), skip=(),
                                backend="reference")
    s = fp8ref.quantize_model(m, skip=(), backend="reference", dense_fallback="auto")
    kept = 2 * 24 * 40 * 2  # two bf16 weights of 24 x 40
    assert (s.dense_fallback, s.dense_layers, s.dense_bytes) == ("auto", 2, kept)
    assert s.bytes_after == off.bytes_after + kept  # the kept weights are in the model's memory
    assert "2 layers keep their original weight (+0.0 MiB" in str(s) and "0 of 0" in str(s)
    m[0].decide_dense(8, dense=True)
    m[2].decide_dense(8, dense=False)
    m(torch.randn(5, 40, dtype=torch.bfloat16))
    got = [(d["layer"], d["N"], d["K"], d["bucket"], d["dense"]) for d in s.dense_decisions()]
    assert got == [("0", 24, 40, 8, True), ("2", 40, 24, 8, False)]
    assert "1 of 2 (layer, bucket) decisions run dense (NxK dtype bucket: 24x40 bfloat16 M<=8)" in str(s)
    assert "dense_fallback='auto' (dense at bfloat16 M<=8: dense (forced))" in repr(m[0])
    assert "dense_fallback='auto' (no bucket dense so far)" in repr(m[2])


def test_state_dict_holds_the_fp8_layer_only_and_a_load_drops_the_kept_weight():
    lin = _linear()
    q = fp8ref.Fp8Linear.from_linear(lin, backend="reference", dense_fallback="auto")
    plain = fp8ref.Fp8Linear.from_linear(lin, backend="reference")
    assert list(q.state_dict()) == list(plain.state_dict())
    q.decide_dense(8, dense=True)
    x = torch.randn(8, 40, dtype=torch.bfloat16)
    assert torch.equal(q(x), F.linear(x, lin.weight, lin.bias))
    other = fp8ref.Fp8Linear.from_linear(_linear(seed=1), backend="reference")
    q.load_state_dict(other.state_dict())  # another layer's codes: the kept weight is not theirs
    with pytest.warns(RuntimeWarning, match="dense fallback dropped"):
        y = q(x)
    assert torch.equal(y, _fp8(other, x)) and "dense_weight" not in dict(q.named_buffers())
    assert "dropped" in q.extra_repr()
    with pytest.raises(ValueError, match="dropped"):
        q.decide_dense(8, dense=True)


def test_a_cast_keeps_the_kept_weight_with_the_codes():
    lin = _linear(dtype=torch.float32)
    q = fp8ref.Fp8Linear.from_linear(lin, backend="reference", dense_fallback="auto").to(torch.bfloat16)
    assert q.dense_weight.dtype == torch.bfloat16 and q.weight.dtype == torch.float8_e4m3fn
    q.decide_dense(4, dense=True)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(q(x), F.linear(x, lin.weight.to(torch.bfloat16), lin.bias.to(torch.bfloat16)))


@pytest.mark.parametrize("bad", ["yes", "Auto", True, 1])
def test_a_bad_dense_fallback_raises_naming_it(bad):
    with pytest.raises(ValueError, match="dense_fallback"):
        fp8ref.Fp8Linear.from_linear(_linear(), dense_fallback=bad)
    with pytest.raises(ValueError, match="dense_fallback"):
        fp8ref.quantize_model(nn.Sequential(_linear()), dense_fallback=bad)


def test_decide_dense_checks_its_arguments():
    off = fp8ref.Fp8Linear.from_linear(_linear(), backend="reference")
    with pytest.raises(ValueError, match="dense_fallback"):
        off.decide_dense(8, dense=True)
    q = fp8ref.Fp8Linear.from_linear(_linear(), backend="reference", dense_fallback="auto")
    for M in (-1, 2.0, True):
        with pytest.raises(ValueError, match="M must be"):
            q.decide_dense(M, dense=True)
    with pytest.raises(ValueError, match="dtype"):
        q.decide_dense(8, torch.float16, dense=True)
    with pytest.raises(TypeError, match="dense must be a bool"):
        q.decide_dense(8, dense=1)


@pytest.mark.slow  # ~15 s: the backends of the tiny model's shapes are selected
def test_bench_model_records_the_decisions(monkeypatch, tiny_bench_model):
    bm = tiny_bench_model
    # Injected: prefill-sized buckets dense, decode FP8 (no timing).
    monkeypatch.setattr(dense, "decide", lambda key, M, f, d, device="cpu": dense.DenseChoice(
        bucket=sel.m_bucket(M), dense=M > 1, ratio=0.5 if M > 1 else 2.0))
    r = bm.bench_model("llama8b", prompt=8, tokens=2, repeat=1, budget_s=0.1, dense_fallback="auto")
    d = r["dense_fallback"]
    assert (d["mode"], d["layers"]) == ("auto", 7) and d["extra_bytes"] > 0
    assert {(x["bucket"], x["dense"]) for x in d["decisions"]} == {(1, False), (8, True)}
    assert "dense_layers" not in r["breakdown"]["fp8"] and r["breakdown"]["fp8"]["fp8_layers"] == 7
    text = bm.format_model_report({"meta": {}, "models": [r]})
    assert "llama8b: dense fallback 'auto': 7 layers keep their original weight" in text
    assert "64x64 bfloat16 M<=8: dense (fp8/dense speed 0.50)" in text


def test_bench_takes_dense_fallback_auto_only():
    from fp8ref.cli import build_parser

    args = build_parser().parse_args(["bench", "--model", "llama8b", "--dense-fallback", "auto"])
    assert args.dense_fallback == "auto" and build_parser().parse_args(["bench"]).dense_fallback is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--dense-fallback", "on"])


@pytest.mark.slow  # ~10 s of compilation
def test_compiled_calls_run_fp8_whatever_the_decision():
    lin = _linear()
    q = fp8ref.Fp8Linear.from_linear(lin, backend="reference", dense_fallback="auto")
    q.decide_dense(8, dense=True)
    x = torch.randn(8, 40, dtype=torch.bfloat16)
    assert torch.equal(q(x), F.linear(x, lin.weight, lin.bias))
    assert torch.equal(torch.compile(q, fullgraph=True)(x), _fp8(q, x))  # the custom op has no dense path
