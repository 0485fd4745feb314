"""fp8ref.bench and ``fp8ref bench``: the timing helper, the byte counts, the ratios and the report.

No test asserts a speed: timings on a shared CPU are noise. They check that every figure is the
ratio it claims to be, computed from the timings of the same run, and that slow or failing
backends are skipped with a reason rather than hang or vanish.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import fp8ref
from fp8ref import FP8_BLOCK, W8A8_FP8, QuantScheme, bench
from fp8ref.cli import main
from fp8ref.kernels.reference import ReferenceBackend
from fp8ref.registry import Backend
from fp8ref.spec.bounds import Accumulation


class _Counter:
    def __init__(self, sleep_s: float = 0.0):
        self.calls, self.sleep_s = 0, sleep_s

    def __call__(self):
        self.calls += 1
        if self.sleep_s:
            time.sleep(self.sleep_s)


def test_timeit_counts_calls_and_samples():
    fn = _Counter()
    t = bench.timeit(fn, warmup=2, repeat=4, min_sample_s=0.5, budget_s=60)
    assert t.samples == 4 and t.inner == 1000  # a trivial call: as many per sample as allowed
    # first call + one more warm-up + one calibration call + the timed calls
    assert fn.calls == 2 + 1 + t.samples * t.inner
    assert 0 < t.min_s <= t.median_s


def test_timeit_long_calls_need_no_calibration():
    fn = _Counter(sleep_s=0.005)
    t = bench.timeit(fn, repeat=3, min_sample_s=0.001, budget_s=60)
    assert (t.samples, t.inner, fn.calls) == (3, 1, 1 + 3)


def test_timeit_stops_at_budget():
    fn = _Counter(sleep_s=0.02)
    t = bench.timeit(fn, repeat=50, budget_s=0.01)
    # the first call already spent the budget: one single-call sample, no more
    assert (t.samples, t.inner, fn.calls) == (1, 1, 2)
    assert t.median_s >= 0.02 and t.first_s >= 0.02


@pytest.mark.parametrize("kw", [{"warmup": 0}, {"repeat": 0}, {"budget_s": 0.0}])
def test_timeit_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        bench.timeit(lambda: None, **kw)
    with pytest.raises(TypeError):
        bench.timeit(42)


@pytest.mark.parametrize("scheme, scales", [
    (QuantScheme(granularity="row"), 6),
    (QuantScheme(granularity="tensor"), 1),
    (QuantScheme(granularity="group", group_size=128), 6 * 3),  # 300 columns: 3 groups, the last partial
    (QuantScheme(granularity="block", block=(4, 128)), 2 * 3),
])
def test_quant_bytes_counts_input_codes_and_scales(scheme, scales):
    # 6 x 300 bf16 in (2 bytes each), one fp8 code out per element, fp32 scales
    assert bench.quant_bytes(6, 300, torch.bfloat16, scheme) == 6 * 300 * (2 + 1) + 4 * scales
    assert bench.quant_bytes(6, 300, torch.float32, scheme) == 6 * 300 * (4 + 1) + 4 * scales


def test_ceilings_are_positive_and_say_what_they_measured():
    c = bench.copy_bandwidth("cpu", 1 << 20, repeat=2, budget_s=0.2)
    assert c["bytes_moved"] == 2 * c["bytes"] == 2 << 20
    assert c["gbps"] == pytest.approx(c["bytes_moved"] / c["timing"]["min_s"] / 1e9)  # a ceiling: the best
    p = bench.bf16_gemm_peak("cpu", [32, 64], repeat=2, budget_s=0.2)
    assert p["gflops"] == max(r["gflops"] for r in p["per_size"])
    assert {r["n"] for r in p["per_size"]} == {32, 64}
    assert all(r["gflops"] == pytest.approx(2 * r["n"] ** 3 / r["timing"]["min_s"] / 1e9) for r in p["per_size"])
    with pytest.raises(ValueError):
        bench.copy_bandwidth("cpu", 0)
    with pytest.raises(ValueError):
        bench.bf16_gemm_peak("cpu", [])


def test_quantization_rows_are_gbps_of_the_counted_bytes():
    rows = bench.bench_quantization("cpu", ["reference"], act_shape=(4, 256), weight_shape=(256, 256),
                                    copy_gbps=10.0, repeat=2, budget_s=0.1)
    assert [r["quant"] for r in rows] == [q for q, _, _ in bench.QUANT_SCHEMES]
    for r in rows:
        assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["frac_of_copy"] == pytest.approx(r["gbps"] / 10.0)
    block = next(r for r in rows if r["quant"] == "block128x128")
    assert block["shape"] == [256, 256] and block["scheme"] == FP8_BLOCK.weight.short_str()


def test_quantization_paired_with_a_copy_is_the_ratio_of_gbps_in_one_round(monkeypatch):
    """frac_of_copy_paired: (quantizer GB/s) / (copy GB/s) from one round's two samples. A fake
    ``paired`` whose rounds give copy 2 ms and quantize 1 ms: the quantizer moves nbytes in 1 ms,
    the copy 2 * copy_bytes in 2 ms."""
    from fp8ref.bench import quantization as q
    from fp8ref.bench.timing import Paired, Timing

    seen = []

    def fake_paired(base, fn, **kw):
        seen.append((base, fn))
        return Paired(2.0, Timing(1e-3, 1e-3, 3, 1, 0.0), Timing(2e-3, 2e-3, 3, 1, 0.0), 3)

    monkeypatch.setattr(q, "paired", fake_paired)
    rows = q.bench_quantization("cpu", ["reference"], act_shape=(4, 256), weight_shape=(256, 256),
                                copy_gbps=10.0, copy_bytes=1 << 20, repeat=2, budget_s=0.05)
    assert len(seen) == len(rows)
    for r in rows:
        want = (r["bytes"] / 1e-3) / (2 * (1 << 20) / 2e-3)
        assert r["frac_of_copy_paired"] == pytest.approx(want)
        assert r["copy_gbps_paired"] == pytest.approx(2 * (1 << 20) / 2e-3 / 1e9) and r["paired_rounds"] == 3
    with pytest.raises(ValueError, match="copy_bytes"):
        q.bench_quantization("cpu", ["reference"], copy_bytes=0)
    text = bench.format_report({"quant": rows, "meta": {}})
    assert "% paired" in text and "paired with a copy" in text


def test_quantization_paired_for_real_is_a_positive_fraction():
    rows = bench.bench_quantization("cpu", ["reference"], act_shape=(4, 256), weight_shape=(256, 256),
                                    copy_bytes=1 << 20, repeat=2, budget_s=0.05)
    assert all(r["frac_of_copy_paired"] > 0 and r["paired_rounds"] >= 1 for r in rows)


class _NoQuantize(Backend):
    name = "test-no-quantize"


def test_quantization_skips_a_backend_that_cannot_quantize():
    rows = bench.bench_quantization("cpu", [_NoQuantize()], act_shape=(2, 128), weight_shape=(128, 128))
    assert len(rows) == len(bench.QUANT_SCHEMES)
    assert all("NotImplementedError" in r["skipped"] and "gbps" not in r for r in rows)


def test_quantization_past_deadline_is_skipped():
    rows = bench.bench_quantization("cpu", ["reference"], act_shape=(2, 128), weight_shape=(128, 128),
                                    deadline=time.perf_counter() - 1)
    assert all("time budget" in r["skipped"] for r in rows)


class _SlowReference(ReferenceBackend):
    """The reference, made slow: every scaled_mm sleeps, to trip max_call_s."""

    name = "test-slow"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        time.sleep(0.03)
        return super().scaled_mm(a, b, bias, out_dtype)


class _Broken(ReferenceBackend):
    name = "test-broken"
    accumulation = Accumulation.FP32

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        raise RuntimeError("kernel launch failed")


def test_linear_rows_are_ratios_to_bf16_and_peak_with_slow_and_broken_backends():
    rows = bench.bench_linear("cpu", ["reference", _SlowReference(), _Broken()], shapes=[(128, 64)],
                              m_values=[1, 4], peak_gflops=100.0, include_auto=False, gemm_only=True,
                              repeat=2, budget_s=0.1, max_call_s=0.02)
    assert [(r["K"], r["N"], r["M"]) for r in rows] == [(128, 64, 1), (128, 64, 4)]
    for r in rows:
        ref = r["backends"]["reference"]
        assert ref["speedup_unpaired"] == pytest.approx(r["bf16_s"] / ref["seconds"])
        assert ref["speedup_vs_bf16"] > 0 and ref["bf16_paired_s"] > 0 and ref["paired_rounds"] >= 1
        assert ref["frac_of_peak"] == pytest.approx(r["flops"] / ref["seconds"] / 1e9 / 100.0)
        assert ref["gemm_speedup_vs_bf16"] == pytest.approx(r["bf16_s"] / ref["gemm_seconds"])
        assert r["bf16_frac_of_peak"] == pytest.approx(r["bf16_gflops"] / 100.0)
        assert "kernel launch failed" in r["backends"]["test-broken"]["error"]
        assert r["fastest"] in ("reference", "test-slow")
    assert "seconds" in rows[0]["backends"]["test-slow"]
    # 0.03 s per call > max_call_s: the larger M is not run, and the row says why
    assert "max_call_s" in rows[1]["backends"]["test-slow"]["skipped"]


def test_fastest_and_auto_ratio():
    from fp8ref.bench import linear as bench_linear_module

    row = {"backends": {"a": {"speedup_vs_bf16": 0.5}, "b": {"speedup_vs_bf16": 1.0},
                        "c": {"speedup_vs_bf16": 2.0}, "auto": {"speedup_vs_bf16": 1 / 1.05}}}
    bench_linear_module._fastest(row, compliant=["a", "b"])  # c is faster but not admitted
    assert row["fastest"] == "b" and row["auto_over_fastest"] == pytest.approx(1.05)
    bench_linear_module._fastest(row)
    assert row["fastest"] == "c" and row["auto_over_fastest"] == pytest.approx(2.1)


def test_auto_is_timed_beside_the_two_fastest_admitted_backends(monkeypatch):
    """auto_over_fastest: auto back to back with each of the two fastest admitted backends, called
    through fp8ref.linear by name; a backend failing there is reported, not raised."""
    from types import SimpleNamespace

    from fp8ref.bench import linear as bench_linear_module

    called = []

    def fake_linear(x, w, bias, recipe, backend):
        called.append(backend)
        if backend == "b":
            raise RuntimeError("kernel launch failed")

    def fake_paired(base, fn, **kwargs):
        fn()
        return SimpleNamespace(ratio={"a": 0.7, "d": 1.5}[called[-1]])

    monkeypatch.setattr(bench_linear_module, "linear", fake_linear)
    monkeypatch.setattr(bench_linear_module, "paired", fake_paired)
    row = {"K": 64, "N": 32, "M": 2,
           "backends": {"a": {"speedup_vs_bf16": 1.5}, "b": {"speedup_vs_bf16": 2.0}, "c": {"speedup_vs_bf16": 3.0},
                        "d": {"speedup_vs_bf16": 1.0}, "auto": {"speedup_vs_bf16": 1.9}}}
    bench_linear_module._fastest(row, ["a", "b", "d"])  # c is the fastest but not admitted
    assert row["fastest"] == "b" and row["auto_over_fastest_via_bf16"] == pytest.approx(2.0 / 1.9)
    bench_linear_module._auto_beside_the_fastest(row, ["a", "b", "d"], lambda: None, [None], lambda: (None, 0),
                                                 W8A8_FP8, device="cpu", repeat=1, budget_s=0.1, log=lambda s: None)
    assert called == ["b", "a"]  # the two fastest admitted, d not timed
    assert row["auto_beside"] == {"a": 0.7} and row["auto_over_fastest"] == 0.7 and row["fastest_beside"] == "a"
    assert "kernel launch failed" in row["auto_beside_errors"]["b"]


def test_auto_beside_its_backend_shares_the_prepared_weight(monkeypatch):
    """The backend timed beside auto runs on the copy fp8ref.linear prepared for auto: a real run
    prepares each weight once through fp8ref.linear, whichever calls time it."""
    from fp8ref import api

    monkeypatch.setenv("FP8REF_CANDIDATES", "reference")
    before = api.STATS["prepare_weight"]
    (row,) = bench.bench_linear("cpu", ["reference"], shapes=[(64, 32)], m_values=[2], repeat=2, budget_s=0.05)
    assert api.STATS["prepare_weight"] - before == 1
    assert set(row["auto_beside"]) == {"reference"} and row["auto_over_fastest"] == row["auto_beside"]["reference"] > 0


def test_paired_ratio_is_the_median_of_back_to_back_rounds(monkeypatch):
    """A machine that slows down 4x after a few calls: the ratio of two medians taken one after
    the other reads the drift (0.5), the paired rounds read the true 2x (each round's two samples
    see the same machine)."""
    from fp8ref.bench import timing

    now = {"t": 0.0, "calls": 0}

    def slow_factor():  # the machine slows down 4x after the fourth call
        return 4.0 if now["calls"] > 4 else 1.0

    def work(cost):
        def f():
            now["calls"] += 1
            now["t"] += cost * slow_factor()
        return f

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now["t"])
    base, fn = work(0.02), work(0.01)  # fn is 2x faster than base
    p = timing.paired(base, fn, repeat=6, budget_s=100.0)
    assert p.rounds == 6 and p.ratio == pytest.approx(2.0)
    # the same two functions timed one after the other, as medians: the drift lands in the ratio
    now.update(t=0.0, calls=0)
    tb = timing.timeit(base, repeat=3, budget_s=100.0)
    tf = timing.timeit(fn, repeat=3, budget_s=100.0)
    assert tb.median_s / tf.median_s == pytest.approx(0.5)


def test_reference_section_ratio_is_from_the_same_run():
    r = bench.bench_reference(M=4, K=128, N=32, quant_shape=(32, 128), repeat=1, budget_s=0.5)
    assert r["scaled_mm_over_fp32_linear"] == pytest.approx(r["scaled_mm"]["seconds"] / r["fp32_linear_s"])
    assert r["quantize"]["gbps"] == pytest.approx(r["quantize"]["bytes"] / r["quantize"]["seconds"] / 1e9)
    assert r["target_scaled_mm_over_fp32_linear"] == 3.0


def _report(backend, *examples, status="pass"):
    """A real conformance report (a renamed field of Report or ContractResult breaks these tests)."""
    from fp8ref.conformance import ContractResult, Report

    return Report(backend=backend, profile="dev", seed=0,
                  results=[ContractResult(f"c{i}", "bounded", status, examples=n) for i, n in enumerate(examples)])


def test_conformance_throughput_counts_examples(monkeypatch):
    import fp8ref.conformance

    calls = []

    def fake_check(backend, profile, seed=None, max_examples=None):
        calls.append((backend, profile, seed, max_examples))
        if backend == "bad":
            raise RuntimeError("boom")
        return _report(backend, 3, 5, status="fail" if backend == "failing" else "pass")

    monkeypatch.setattr(fp8ref.conformance, "check", fake_check)
    rows = bench.bench_conformance(["reference", "bad", "failing"], profile="dev", max_examples=4)
    assert calls == [("reference", "dev", 0, 4), ("bad", "dev", 0, 4), ("failing", "dev", 0, 4)]
    assert rows[0]["examples"] == 8 and rows[0]["passed"] is True
    assert rows[0]["examples_per_s"] == pytest.approx(8 / rows[0]["seconds"])
    assert "boom" in rows[1]["error"]
    assert rows[2]["passed"] is False


def test_conformance_section_without_the_extra_says_so(monkeypatch):
    """Without hypothesis (the conformance extra) fp8ref.conformance cannot import: skipped, with why."""
    import sys

    for name in [m for m in sys.modules if m == "fp8ref.conformance" or m.startswith("fp8ref.conformance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr("fp8ref.conformance", raising=False)
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis -> ImportError
    (row,) = bench.bench_conformance(["reference"])
    assert row["backend"] == "reference" and "needs the conformance extra" in row["skipped"]


def test_a_real_conformance_run_is_counted():
    (row,) = bench.bench_conformance(["reference"], profile="dev", max_examples=1)
    assert row["passed"] is True and row["examples"] > 0 and row["examples_per_s"] > 0


def test_selector_section_keeps_the_users_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8REF_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setenv("FP8REF_CANDIDATES", "reference")  # keep the probe short
    s = bench.bench_selector("cpu", M=2, K=64, N=32, overhead_shape=(1, 32, 16), repeat=2, budget_s=0.1)
    assert s["selected"] == s["selected_at_first_shape"] == "reference"
    assert s["overhead_shape"] == [1, 32, 16]
    assert s["dispatch_overhead_s"] == pytest.approx(s["auto_min_s"] - s["named_min_s"])
    assert s["first_call_s"] >= s["first_selection_s"] >= 0
    import os

    assert os.environ["FP8REF_CACHE_DIR"] == str(tmp_path / "user-cache")
    assert not (tmp_path / "user-cache").exists()  # the measurement used its own temporary cache


def test_linear_section_decides_auto_anew_without_the_users_cache(monkeypatch, tmp_path):
    """A decision the user's on-disk cache holds (from an earlier fp8ref, or another load) is not
    what the bench times: auto selects again against a throw-away cache, and the user's is untouched."""
    import os

    user = tmp_path / "user-cache"
    monkeypatch.setenv("FP8REF_CACHE_DIR", str(user))
    monkeypatch.setenv("FP8REF_CANDIDATES", "reference")  # keep the probe short
    (row,) = bench.bench_linear("cpu", ["reference"], shapes=[(64, 32)], m_values=[2], repeat=1, budget_s=0.05)
    assert row["backends"]["auto"]["selected"] == "reference"
    assert os.environ["FP8REF_CACHE_DIR"] == str(user) and not user.exists()


def test_run_rejects_bad_device_and_sections():
    with pytest.raises(ValueError, match="device"):
        bench.run("tpu")
    with pytest.raises(ValueError, match="sections"):
        bench.run("cpu", sections=("ceilings", "nope"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda"):
            bench.run("cuda")


def test_run_and_report_on_a_tiny_problem():
    res = bench.run("cpu", quick=True, backends_only=["reference", "no-such-backend"], shapes=[(128, 64)],
                    m_values=[2], sections=("ceilings", "linear"))
    json.dumps(res)  # JSON-able as is
    assert res["backends"] == ["reference"] and res["backends_skipped"]["no-such-backend"] == "not registered"
    assert res["linear"][0]["backends"]["reference"]["frac_of_peak"] > 0
    text = bench.format_report(res)
    assert "memory copy" in text and "bf16 GEMM peak" in text and "reference" in text
    assert "speed-up over bf16 F.linear" in text


def test_report_formats_every_section():
    res = {
        "meta": {"device": "cpu", "torch": "x", "cpu_count": 2, "torch_threads": 2, "date_utc": "d",
                 "loadavg_start": [1.0, 0, 0], "loadavg_end": [2.0, 0, 0], "elapsed_s": 3.0,
                 "cpu_model": "Some CPU", "cpu_kind": "avx2", "cpu_flags": ["avx2", "fma", "f16c"],
                 "kernel_paths": {"cpu-fp8": "avx2 kernel", "cpu-fp8-amx": "not run: no AMX"}},
        "backends_skipped": {"triton": "unavailable: no CUDA"},
        "copy": {"gbps": 10.0}, "bf16_peak": {"gflops": 100.0, "n": 2048},
        "quant": [{"backend": "b", "quant": "per-token", "shape": [2, 3], "gbps": 5.0, "frac_of_copy": 0.5},
                  {"backend": "b", "quant": "per-tensor", "shape": [2, 3], "skipped": "no"},
                  {"backend": "c", "quant": "per-token", "shape": [2, 3], "gbps": 5.0, "frac_of_copy": 0.5},
                  {"backend": "c", "quant": "per-group128", "shape": [2, 3], "gbps": 3.0, "frac_of_copy": 0.3}],
        "linear": [{"K": 8, "N": 8, "M": 1, "bf16_s": 1e-3, "bf16_frac_of_peak": 0.25, "fastest": "b",
                    "auto_over_fastest": 1.01,
                    "backends": {"b": {"speedup_vs_bf16": 1.5, "frac_of_peak": 0.375, "gemm_speedup_vs_bf16": 2.0},
                                 "auto": {"skipped": "x"}}},
                   # auto timed beside b and c: c ran fastest beside it, and the report names c
                   {"K": 8, "N": 8, "M": 2, "bf16_s": 1e-3, "fastest": "b", "fastest_beside": "c",
                    "auto_over_fastest": 1.02, "auto_beside": {"b": 0.99, "c": 1.02},
                    "backends": {"b": {"speedup_vs_bf16": 1.5}, "c": {"speedup_vs_bf16": 1.4},
                                 "auto": {"speedup_vs_bf16": 1.45}}}],
        "reference": {"scaled_mm": {"M": 128, "K": 4096, "N": 4096}, "scaled_mm_over_fp32_linear": 2.8,
                      "target_scaled_mm_over_fp32_linear": 3.0,
                      "quantize": {"shape": [4096, 4096], "gbps": 0.1}},
        "selector": {"M": 16, "K": 8, "N": 8, "first_selection_s": 0.5, "disk_lookup_s": 0.01,
                     "overhead_shape": [1, 4, 4], "dispatch_overhead_s": 2e-6, "auto_min_s": 1e-4,
                     "selected": "b", "selected_at_first_shape": "c"},
        "conformance": [{"backend": "b", "profile": "dev", "examples_per_s": 10.0, "examples": 20, "seconds": 2.0,
                         "passed": True}, {"backend": "c", "skipped": "not available"}],
    }
    text = bench.format_report(res)
    for s in ("50.0", "1.500/ 37.5%", "1.010 (b)", "1.020 (c)", "2.80 x fp32 F.linear (target <= 3)", "2.0 us per call",
              "10.0 examples/s", "first selection (probe + timing) at M=16 K=8 N=8: 500.0 ms", "(picks c)",
              "dispatch overhead at M=1 K=4 N=4: 2.0 us per call (2.0 % of the auto call)",
              "triton (unavailable: no CUDA)", "load average at start 1.00, at end 2.00",
              "K=8 N=8 M=1 b: 2.000", "skipped: no", "picks b",
              "CPU: Some CPU (kind avx2; kernel flags: avx2 fma f16c)",
              "kernel paths: cpu-fp8: avx2 kernel; cpu-fp8-amx: not run: no AMX",
              "b            slowest per-token 50.0 % of copy: every measured scheme >= 40 %: yes",
              "c            slowest per-group128 30.0 % of copy: every measured scheme >= 40 %: no"):
        assert s in text, s
    tables = [line for line in text.splitlines() if line.startswith(("ceilings", "quantization", "linear",
                                                                     "reference", "selector", "conformance"))]
    assert len(tables) == 6 and all("[on Some CPU, kind avx2]" in t for t in tables), tables


def test_cli_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "sub" / "bench.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--quick", "--threads", "1", "--backend", "reference", "--shape", "128x64", "--m", "1,2",
                   "--sections", "ceilings,linear", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["M"] for r in res["linear"]] == [1, 2] and res["meta"]["torch_threads"] == 1
    from fp8ref._machine import cpu_kind, cpu_model, cpu_signature

    assert res["meta"]["cpu_model"] == cpu_model() and res["meta"]["cpu_kind"] == cpu_kind()
    sig = cpu_signature()
    assert (res["meta"]["cpu_vendor"], res["meta"]["cpu_family"], res["meta"]["cpu_model_number"]) == (
        sig["vendor"], sig["family"], sig["model"])
    from fp8ref.kernels.cpu_fp8 import gemm_path

    assert res["meta"]["kernel_paths"]["cpu-fp8"] == f"{gemm_path()} kernel"
    amx = fp8ref.get_backend("cpu-fp8-amx").available()
    assert (res["meta"]["kernel_paths"]["cpu-fp8-amx"] == f"not run: {amx}") == (amx is not None)
    assert res["meta"]["command"] == ("fp8ref bench --device cpu --quick --threads 1 --backend reference "
                                      f"--shape 128x64 --m 1,2 --sections ceilings,linear --json {out}")
    assert "speed-up over bf16" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--shape", "4096"], ["--shape", "0x4"], ["--m", "1,x"], ["--m", "0"],
                                  ["--sections", "linear,nope"], ["--device", "tpu"], ["--threads", "0"]])
def test_cli_bench_rejects_bad_options(argv):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2


def test_cli_bench_unknown_backend_is_an_error_before_any_work(capsys, tmp_path):
    """A misspelt --backend (or a comma list before commas were accepted) used to run a benchmark of
    nothing but ``auto`` and exit 0."""
    out = tmp_path / "b.json"
    assert main(["bench", "--sections", "linear", "--backend", "cpu-fp8,nope", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--backend: no backend named 'nope'" in err and "reference" in err
    assert not out.exists()


def test_cli_bench_backend_takes_commas_and_repeats(tmp_path):
    out = tmp_path / "b.json"
    threads = torch.get_num_threads()
    rc = main(["bench", "--quick", "--threads", "1", "--sections", "linear", "--shape", "64x32", "--m", "1",
               "--backend", "reference,torch", "--backend", "cpu-fp32", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    ran = set(res["linear"][0]["backends"]) - {"auto"}
    assert ran == {"reference", "torch", "cpu-fp32"} - set(res["backends_skipped"]), (ran, res["backends_skipped"])
    assert "--backend reference --backend torch --backend cpu-fp32" in res["meta"]["command"]
    assert torch.get_num_threads() == threads, "--threads must not outlive the call"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cli_bench_cuda_without_cuda_says_so(capsys):
    assert main(["bench", "--device", "cuda", "--quick"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_quant_schemes_cover_the_issue():
    names = {q: (role, s) for q, role, s in bench.QUANT_SCHEMES}
    assert names["per-token"] == ("activation", W8A8_FP8.activation)
    assert names["per-group128"][1].group_size == 128
    assert names["per-tensor"][1].granularity.value == "tensor"
    assert names["per-channel"] == ("weight", W8A8_FP8.weight)
    assert names["block128x128"][1].block == (128, 128)
    assert bench.LLAMA3_8B_SHAPES == ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144))
    assert bench.M_VALUES == (1, 16, 128, 1024)


@pytest.mark.parametrize("name", ["fp8ref.bench", "fp8ref.gpu_check"])
def test_docstring_examples_run(name):
    import doctest
    import importlib
    import pkgutil

    package = importlib.import_module(name)
    attempted = 0
    for info in pkgutil.iter_modules(package.__path__, name + "."):
        if info.name.endswith("__main__"):
            continue
        result = doctest.testmod(importlib.import_module(info.name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, info.name
        attempted += result.attempted
    assert attempted > 0


def _load_bench_conftest():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "conftest.py"
    spec = importlib.util.spec_from_file_location("fp8ref_benchmarks_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _FakeBenchmark:
    def __init__(self, median):
        self.extra_info = {}
        self.stats = None if median is None else type("M", (), {"stats": type("S", (), {"median": median})()})()


def test_benchmarks_ratio_board():
    board = _load_bench_conftest().RatioBoard()
    base, fast, off = _FakeBenchmark(2.0), _FakeBenchmark(0.5), _FakeBenchmark(None)
    board.record(base, "g", "copy", work=4e9, unit="B", baseline=True)
    board.record(fast, "g", "quantize", work=1e9, unit="B")
    board.record(off, "g", "disabled", work=1e9, unit="B")  # benchmarks disabled: nothing recorded
    assert base.extra_info == {"B_per_s": 2e9}
    assert fast.extra_info == {"B_per_s": 2e9, "throughput_over_baseline": 1.0, "time_over_baseline": 0.25,
                               "baseline": "copy"}
    assert off.extra_info == {}
    text = "\n".join(board.lines())
    assert "g  (baseline: copy)" in text and "throughput x1.000 of baseline, time x0.250" in text
    assert "disabled" not in text


def test_linear_auto_errors_and_m_order(monkeypatch):
    from fp8ref.bench import linear as bench_linear_module

    def broken_linear(*args, **kwargs):
        raise RuntimeError("no backend is compliant")

    monkeypatch.setattr(bench_linear_module, "linear", broken_linear)
    rows = bench.bench_linear("cpu", ["reference"], shapes=[(64, 32)], m_values=[4, 1], repeat=1, budget_s=0.05)
    assert [r["M"] for r in rows] == [1, 4]  # ascending, so max_call_s skips only larger M
    assert all("no backend is compliant" in r["backends"]["auto"]["error"] for r in rows)
    assert all("seconds" in r["backends"]["reference"] for r in rows)


def test_linear_auto_runs_and_names_its_choice(monkeypatch):
    monkeypatch.setenv("FP8REF_CANDIDATES", "reference")
    (row,) = bench.bench_linear("cpu", ["reference"], shapes=[(64, 32)], m_values=[2], repeat=1, budget_s=0.05)
    auto = row["backends"]["auto"]
    assert auto["selected"] == "reference" and auto["weight"] == "pre-quantized" and auto["seconds"] > 0
    assert auto["precision"] == fp8ref.select.DEFAULT_PRECISION


def test_interpreted_triton_is_left_out_of_the_bench_unless_named(monkeypatch):
    """Under TRITON_INTERPRET=1 the triton backend is available (CI certifies it that way) but an
    interpreted call at benchmark shapes takes minutes: `fp8ref bench` leaves it out with the
    reason, and still times it when the user names it."""
    pytest.importorskip("triton")
    from fp8ref.bench.backends import available_backends
    from fp8ref.registry import backends as registered

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not next(i for i in registered() if i.name == "triton").available:
        pytest.skip("the triton backend is unavailable here")
    names, skipped = available_backends("cpu")
    assert "triton" not in names
    assert "Triton's CPU interpreter" in skipped["triton"] and "--backend" in skipped["triton"]
    names, skipped = available_backends("cpu", ["triton"])
    assert names == ["triton"] and "triton" not in skipped
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "not timed" not in available_backends("cpu")[1].get("triton", "")


def test_ratios_under_load_are_marked_unreliable(monkeypatch):
    """A load average above the thread count: the ratios print marked, the JSON says why (issue 42)."""
    from fp8ref.bench import machine_meta
    from fp8ref.bench.load import unreliable_reason
    from fp8ref.bench.model import format_model_report

    phase = {"bf16_tokens_per_s": 10.0, "fp8_tokens_per_s": 15.0, "ratio": 1.5, "rounds": 3}
    row = {"model": "m", "quantized_layers": 2, "eager": {"decode": phase, "prefill": phase}}
    for load, marked in ((9.0, True), (1.5, False)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        meta = {**machine_meta("cpu", True), "torch_threads": 2}
        text = format_model_report({"meta": meta, "models": [row]})
        assert ("UNRELIABLE" in text) == marked and ("1.50x?" in text) == marked
        assert (unreliable_reason(meta) is not None) == marked
        assert ("UNRELIABLE" in bench.format_report({"meta": meta})) == marked


def test_decode_gemv_is_a_fraction_of_a_read_stream():
    """The decode GEMVs against a read-only pass over the same bytes, paired (issue 42)."""
    from fp8ref.bench.gemv import GEMV_TARGET, bench_gemv, format_gemv

    r = bench_gemv(shapes=[(64, 32), (32, 16)], backend="reference", repeat=2, budget_s=0.2)
    assert r["bytes"] == 64 * 32 + 32 * 4 + 32 * 16 + 16 * 4 and r["fits_in_cache"]
    assert r["fraction_of_stream"] > 0 and r["target"] == GEMV_TARGET and r["rounds"] >= 1
    line = format_gemv(r)
    assert "% of a read-only stream over the same bytes" in line and "not a memory figure" in line
    assert format_gemv(r) in bench.format_report({"meta": {}, "gemv": r})
    u = bench_gemv(shapes=[(64, 32)], backend="reference", repeat=1, budget_s=0.1, codes="uniform")
    assert u["codes"] == "uniform" and "worst case" in format_gemv(u)
    assert format_gemv(u) in bench.format_report({"meta": {}, "gemv": r, "gemv_uniform": u})


def test_decode_gemv_weights_are_those_of_a_quantized_model():
    """The GEMV's codes are ``fp8ref.quantize`` of normal rows (few zero/subnormal codes), the
    worst case's uniform over the finite codes; both finite, made a block of rows at a time."""
    from fp8ref.bench.gemv import _random_weight
    from fp8ref.kernels.cpu_fp8 import pack_weight

    g = torch.Generator().manual_seed(0)
    q = _random_weight(1040, 4096, g)  # blocks of 1024 rows at K = 4096, the last one short; N % 16 == 0
    u = _random_weight(1040, 4096, g, "uniform")  # (pack_weight pads N with zero codes: special groups)
    for w in (q, u):
        codes = w.data.view(torch.uint8)
        assert not bool(((codes & 0x7F) == 0x7F).any()) and bool(torch.isfinite(w.scale).all())
    special = [pack_weight(w.data.view(torch.uint8))[1].float().mean().item() for w in (q, u)]
    assert special[0] < 0.02 and special[1] > 0.8, special
    with pytest.raises(ValueError, match="codes"):
        _random_weight(2, 2, g, "gaussian")
