"""The CPU-checkable parts of the GPU evidence run (fp8ref.gpu_check, scripts/gpu_check.sh).

The GPU run itself needs an NVIDIA device; here: its arguments, the target evaluation on made-up
numbers, the JSON and Markdown writers, the clean refusal without CUDA, the child-process time
limit, and a ``--device cpu`` dry run of the whole pipeline on a tiny problem.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fp8ref.conformance
from fp8ref import W8A8_FP8, gpu_check, quantize, scaled_mm
from fp8ref.conformance import ContractResult, Report
from fp8ref.gpu_check import steps, summary
from fp8ref.registry import Backend, Case
from fp8ref.spec.bounds import Accumulation, PrecisionClass

ROOT = Path(__file__).resolve().parents[1]


def test_parser_defaults_fit_the_budget():
    a = gpu_check.build_parser().parse_args([])
    assert a.device == "cuda" and a.budget_s == 420 and a.budget_s < 8 * 60
    assert a.profile == "ci" and a.steps == "conformance,accumulator,bench" and not a.quick
    a = gpu_check.build_parser().parse_args(["--shape", "4096x14336", "--m", "1,1024", "--backend", "torch",
                                             "--out", "x", "--device", "cpu", "--quick"])
    assert a.shape == [(4096, 14336)] and a.m == [1, 1024] and a.backend == ["torch"] and a.out == Path("x")


@pytest.mark.parametrize("argv", [["--shape", "12"], ["--device", "rocm"], ["--m", "-1"], ["--budget-s", "x"]])
def test_parser_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit):
        gpu_check.build_parser().parse_args(argv)


def test_bad_steps_and_budget_refuse_to_start(capsys, tmp_path):
    assert gpu_check.main(["--steps", "bench,nope", "--out", str(tmp_path)]) == gpu_check.EXIT_NO_DEVICE
    assert "--steps" in capsys.readouterr().err
    assert gpu_check.main(["--budget-s", "0", "--out", str(tmp_path)]) == gpu_check.EXIT_NO_DEVICE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_no_cuda_says_so_and_exits_2(capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--device cpu" in err
    assert not (tmp_path / "o").exists()  # nothing half-written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout")
def test_script_without_cuda_exits_2(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "o")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no CUDA device" in (tmp_path / "o" / "gpu_check.log").read_text()


def _row(M, bf16_s, backends, K=4096, N=4096):
    return {"K": K, "N": N, "M": M, "bf16_s": bf16_s, "backends": backends}


def _fake_bench():
    return {
        "linear": [
            _row(1, 1.0, {"torch": {"seconds": 0.5, "speedup_vs_bf16": 2.0}, "auto": {"seconds": 0.51}}),
            _row(1024, 1.0, {
                "torch": {"seconds": 0.7, "speedup_vs_bf16": 1.43, "gemm_speedup_vs_bf16": 1.6},  # exactly 1.6
                "torch-fast": {"seconds": 0.4, "speedup_vs_bf16": 2.5, "gemm_speedup_vs_bf16": 3.0},
                "auto": {"seconds": 0.72, "selected": "torch"}}),
            _row(1024, 1.0, {"torch": {"seconds": 0.9, "speedup_vs_bf16": 1.1, "gemm_speedup_vs_bf16": 1.2},
                             "auto": {"seconds": 1.0}}, K=14336),
        ],
        "quant": [
            {"backend": "torch", "quant": "per-token", "frac_of_copy": 0.71},
            {"backend": "triton", "quant": "per-token", "frac_of_copy": 0.95},
            {"backend": "torch", "quant": "per-group128", "frac_of_copy": 0.5},
            {"backend": "torch", "quant": "per-channel", "frac_of_copy": 0.1},  # a weight scheme: no target
        ],
    }


def _by(targets, name):
    return {t["case"]: t for t in targets if t["target"] == name}


def test_targets_on_fake_numbers_with_compliance():
    t = gpu_check.evaluate_targets(_fake_bench(), compliant=["torch"])
    gemm = _by(t, "fp8_gemm_vs_bf16")
    assert set(gemm) == {"K=4096 N=4096 M=1024", "K=14336 N=4096 M=1024"}  # M >= 1024 only
    ok = gemm["K=4096 N=4096 M=1024"]
    assert ok["passed"] is True and ok["value"] == 1.6 and "torch (GEMM alone)" in ok["detail"]
    assert gemm["K=14336 N=4096 M=1024"]["passed"] is False
    q = _by(t, "act_quant_vs_copy")
    assert q["per-token"]["value"] == 0.71 and q["per-token"]["passed"] is True  # triton not compliant
    assert q["per-group128"]["passed"] is False
    assert q["per-tensor"]["passed"] is None and "no data" in q["per-tensor"]["detail"]
    assert "per-channel" not in q
    auto = _by(t, "auto_vs_fastest")
    assert auto["K=4096 N=4096 M=1"]["value"] == pytest.approx(1.02) and auto["K=4096 N=4096 M=1"]["passed"]
    # torch-fast is faster but not compliant: auto is compared with torch
    assert auto["K=4096 N=4096 M=1024"]["value"] == pytest.approx(0.72 / 0.7)
    assert auto["K=4096 N=4096 M=1024"]["passed"] is True
    assert auto["K=14336 N=4096 M=1024"]["passed"] is False
    assert gpu_check.overall(t) is False


def test_targets_without_compliance_count_every_backend():
    t = gpu_check.evaluate_targets(_fake_bench())
    gemm = _by(t, "fp8_gemm_vs_bf16")["K=4096 N=4096 M=1024"]
    assert gemm["value"] == 3.0 and "torch-fast" in gemm["detail"]
    assert _by(t, "act_quant_vs_copy")["per-token"]["value"] == 0.95
    assert _by(t, "auto_vs_fastest")["K=4096 N=4096 M=1024"]["value"] == pytest.approx(0.72 / 0.4)


def test_targets_take_linear_when_gemm_alone_is_missing_and_custom_thresholds():
    res = {"linear": [_row(2048, 1.0, {"b": {"seconds": 0.5, "speedup_vs_bf16": 2.0}})], "quant": []}
    t = gpu_check.evaluate_targets(res, targets=dict(gpu_check.TARGETS, fp8_gemm_speedup_min=2.5))
    g = _by(t, "fp8_gemm_vs_bf16")["K=4096 N=4096 M=2048"]
    assert g["passed"] is False and "incl. activation quantization" in g["detail"] and g["threshold"] == 2.5
    assert _by(t, "auto_vs_fastest")["all shapes"]["passed"] is None


def test_targets_with_no_data_never_pass():
    t = gpu_check.evaluate_targets({})
    assert t and all(x["passed"] is None for x in t)
    assert gpu_check.overall(t) is None
    assert gpu_check.overall([]) is None
    assert gpu_check.overall([{"passed": True}, {"passed": True}]) is True
    assert gpu_check.overall([{"passed": True}, {"passed": None}]) is None


@dataclass
class _Rep:
    name: str
    value: float


def test_jsonable_handles_peer_objects():
    obj = {"t": torch.tensor([1.0, 2.0]), "big": torch.zeros(100), "nan": math.nan, "dc": _Rep("a", 1.0),
           "enum": PrecisionClass.FAST, "set": {3}, 4: "k"}
    out = summary.jsonable(obj)
    json.dumps(out)
    assert out["t"] == [1.0, 2.0] and out["big"].startswith("<tensor (100,)")
    assert out["nan"] == "nan" and out["dc"] == {"name": "a", "value": 1.0}
    assert out["enum"] == PrecisionClass.FAST.value and out["set"] == [3] and out["4"] == "k"


def test_writers_produce_json_and_markdown(tmp_path):
    bench = _fake_bench()
    bench.update(copy={"gbps": 4300.0}, bf16_peak={"gflops": 790000.0, "n": 8192},
                 selector={"M": 16, "K": 4096, "N": 4096, "first_selection_s": 1.5, "disk_lookup_s": 0.002,
                           "dispatch_overhead_s": 3e-6, "selected": "torch"})
    res = {"meta": {"gpu": "NVIDIA H200", "torch": "2.11", "cuda": "13.0", "elapsed_s": 300, "budget_s": 420,
                    "command": "python -m fp8ref.gpu_check"},
           "backends_skipped": {"sgl-kernel": "not importable"}, "errors": {},
           "conformance": [{"backend": "torch", "status": "ok", "passed": False, "examples": 200, "seconds": 10.0,
                            "accumulator_bits": 24, "failures": ["scaled_mm.bound (fail)"]},
                           {"backend": "triton", "status": "timeout", "reason": "no answer within 120 s"}],
           "accumulator_bits": [{"backend": "torch", "status": "ok", "bits": 24},
                                {"backend": "torch-fast", "status": "ok", "bits": 14}],
           "bench": bench}
    res["targets"] = gpu_check.evaluate_targets(bench, ["torch"])
    res["overall"] = gpu_check.overall(res["targets"])
    p = gpu_check.write_json(res, tmp_path / "out")
    assert json.loads(p.read_text())["meta"]["gpu"] == "NVIDIA H200"
    assert not list((tmp_path / "out").glob("*.tmp"))
    md = gpu_check.write_summary(res, tmp_path / "out").read_text()
    for s in ("# fp8ref GPU check: NVIDIA H200", "| torch-fast | on | 14 |", "| torch | off | 24 |",
              "| triton | - | timeout |",
              "| torch | - | ok | False | 200 | 24 | 10.0 | failing: scaled_mm.bound (fail) |",
              "device-to-device copy: 4300.0 GB/s", "790.0 TFLOP/s",
              "| fp8_gemm_vs_bf16 | K=4096 N=4096 M=1024 | 1.600 | >= 1.6 | PASS |", "FAIL", "NO DATA",
              "**Overall: FAIL**", "`sgl-kernel`: not importable", "1500.0 ms; from the disk cache 2.00 ms",
              "dispatch overhead per call: 3.0 us (picks torch)"):
        assert s in md, s
    assert "Dry run" not in md


def test_cuda_backends_excludes_the_reference_and_names_every_gpu_backend():
    names, skipped = gpu_check.cuda_backends("cpu")
    assert "reference" not in names
    for b in gpu_check.GPU_BACKENDS:
        assert b in names or b in skipped
    names, skipped = gpu_check.cuda_backends("cpu", only=["torch"])
    assert set(names) | set(skipped) == {"torch"}


def test_child_process_time_limit():
    r = steps.run_task("conformance", "reference", "dev", "cpu", timeout_s=0.01, in_process=False)
    assert r["status"] == "timeout" and "no answer within" in r["reason"]


def test_worker_without_the_conformance_extra_says_so(monkeypatch):
    for name in [m for m in sys.modules if m == "fp8ref.conformance" or m.startswith("fp8ref.conformance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr("fp8ref.conformance", raising=False)
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis -> ImportError
    r = steps.worker("accumulator_bits", "reference", "dev", "cpu")
    assert r["status"] == "not available" and "needs the conformance extra" in r["reason"]


def test_worker_measures_accumulator_bits():
    r = steps.worker("accumulator_bits", "reference", "dev", "cpu")
    assert r["status"] == "ok" and r["bits"] == fp8ref.conformance.accumulator_bits(fp8ref.get_backend("reference"))


def _report(backend, status="pass", examples=4, **kw):
    """A real conformance report: a renamed field of Report or ContractResult breaks these tests."""
    return Report(backend=backend, profile="dev", seed=0, **kw,
                  results=[ContractResult("scaled_mm.bound", "bounded", status, examples=examples),
                           ContractResult("quantize.exact", "exact", "pass", examples=examples)])


def test_dry_run_on_cpu(tmp_path, monkeypatch, capsys):
    """The whole pipeline on the CPU, tiny: conformance (a fake, fast check), bench, targets, files."""
    seen = []

    def fake_check(backend, profile):
        seen.append((backend.name, profile))
        return _report(backend.name, "fail" if backend.name == "cpu-fp32" else "pass")

    monkeypatch.setattr(fp8ref.conformance, "check", fake_check)
    names, _ = gpu_check.cuda_backends("cpu")
    backends = ["reference"] + names[:2]
    monkeypatch.setenv("FP8REF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FP8REF_CANDIDATES", ",".join(backends))  # auto's probe: only these
    out = tmp_path / "gc"
    argv = ["--device", "cpu", "--quick", "--out", str(out), "--in-process", "--steps", "conformance,bench",
            "--profile", "dev", "--shape", "64x32", "--m", "1,16", "--budget-s", "60"]
    for b in backends:
        argv += ["--backend", b]
    rc = gpu_check.main(argv)
    assert rc == gpu_check.EXIT_OK
    assert seen == [(b, "dev") for b in names[:2]]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["meta"]["dry_run"] is True and res["meta"]["command"].startswith("python -m fp8ref.gpu_check")
    assert [c["backend"] for c in res["conformance"]] == names[:2]
    assert res["compliant"] == [b for b in names[:2] if b != "cpu-fp32"]
    assert [r["M"] for r in res["bench"]["linear"]] == [1, 16]
    assert {t["target"] for t in res["targets"]} == {"fp8_gemm_vs_bf16", "act_quant_vs_copy", "auto_vs_fastest"}
    md = (out / "summary.md").read_text()
    assert "Dry run on the CPU" in md and "## Targets" in md
    assert "## Targets" in capsys.readouterr().out


class _Spy(Backend):
    """Records the devices it sees; computes like the reference."""

    name = "spy"
    accumulation = Accumulation.FP32
    output_roundings = 2

    def __init__(self):
        self.cases, self.devices = [], []

    def supports(self, case):
        self.cases.append(case)
        return None

    def quantize(self, x, scheme):
        self.devices.append(x.device.type)
        return quantize(x, scheme)

    def prepare_weight(self, w):
        self.devices.append(w.data.device.type)
        return w

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        self.devices.append(a.data.device.type)
        return scaled_mm(a, b, bias, out_dtype)


def test_on_device_keeps_declarations_and_moves_the_case():
    spy = _Spy()
    b = gpu_check.OnDevice(spy, "cpu")
    assert (b.name, b.accumulation, b.output_roundings, b.precision) == ("spy", Accumulation.FP32, 2, spy.precision)
    case = Case(M=1, N=2, K=3, recipe=W8A8_FP8, device="cuda")
    assert b.supports(case) is None and spy.cases[-1].device == "cpu"
    x = torch.randn(4, 32)
    q = b.quantize(x, W8A8_FP8.activation)
    assert torch.equal(q.data.float(), quantize(x, W8A8_FP8.activation).data.float())
    y = b.scaled_mm(q, b.prepare_weight(q), torch.ones(4), torch.float32)
    assert torch.equal(y, scaled_mm(q, q, torch.ones(4), torch.float32))
    assert spy.devices == ["cpu", "cpu", "cpu"]


def test_conformance_of_a_wrapped_backend_runs():
    from fp8ref import get_backend

    report = fp8ref.conformance.check(gpu_check.OnDevice(get_backend("reference"), "cpu"), "dev", seed=0,
                   contracts=["scaled_mm.bound"], max_examples=3)
    assert report.passed and report.backend == "reference"


def test_worker_reads_a_report(monkeypatch):
    got = []

    def fake_check(backend, profile):
        got.append((backend, profile))
        return _report("reference", "fail", examples=3, accumulator_bits=14)

    monkeypatch.setattr(fp8ref.conformance, "check", fake_check)
    r = steps.worker("conformance", "reference", "dev", "cpu")
    assert r["status"] == "ok" and r["passed"] is False and r["examples"] == 6
    assert r["failures"] == ["scaled_mm.bound (fail)"] and r["accumulator_bits"] == 14
    assert r["report"]["passed"] is False and json.dumps(r)
    assert got[0][0].name == "reference" and not isinstance(got[0][0], gpu_check.OnDevice)
    steps.worker("conformance", "reference", "dev", "cuda")  # the suite's CPU inputs go to the device
    assert isinstance(got[1][0], gpu_check.OnDevice) and got[1][0].device.type == "cuda"


def test_worker_reports_an_unavailable_backend(monkeypatch):
    monkeypatch.setattr(fp8ref.conformance, "check",
                        lambda backend, profile: Report(backend.name, profile, 0, available=False, reason="no GPU"))
    r = steps.worker("conformance", "reference", "dev", "cpu")
    # an unavailable backend ran nothing, so it is not certified (issue 11: no certificate on nothing)
    assert (r["status"], r["reason"], r["examples"], r["passed"]) == ("unavailable", "no GPU", 0, False)


def test_conformance_timeout_is_retried_with_the_smallest_profile(tmp_path, monkeypatch):
    calls = []

    def fake_run_task(task, backend, profile, device, *, timeout_s, in_process):
        calls.append((task, backend, profile))
        if profile == "ci":
            return {"backend": backend, "status": "timeout", "reason": "no answer within 1 s", "seconds": 1.0}
        return {"backend": backend, "status": "ok", "passed": True, "examples": 7, "seconds": 0.5}

    monkeypatch.setattr(steps, "run_task", fake_run_task)
    names, _ = gpu_check.cuda_backends("cpu")
    if not names:
        pytest.skip("no non-reference backend registered on this machine")
    rc = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--steps", "conformance", "--backend", names[0]])
    assert calls == [("conformance", names[0], "ci"), ("conformance", names[0], "dev")]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    c = res["conformance"][0]
    assert c["status"] == "ok" and c["profile"] == "dev" and c["first_try"]["status"] == "timeout"
    assert res["compliant"] == [names[0]]
    assert "profile ci: timeout after 1 s" in (tmp_path / "summary.md").read_text()
    assert rc == gpu_check.EXIT_OK  # a dry run that completed


def test_auto_is_compared_only_with_backends_it_may_pick():
    row = _row(16, 1.0, {"torch": {"seconds": 0.7, "precision": "strict"},
                         "torch-fast": {"seconds": 0.4, "precision": "fast"},
                         "auto": {"seconds": 0.72, "precision": "standard"}})
    t = _by(gpu_check.evaluate_targets({"linear": [row]}), "auto_vs_fastest")["K=4096 N=4096 M=16"]
    assert t["value"] == pytest.approx(0.72 / 0.7) and "fastest: torch" in t["detail"]
    row["backends"]["auto"]["precision"] = "fast"
    t = _by(gpu_check.evaluate_targets({"linear": [row]}), "auto_vs_fastest")["K=4096 N=4096 M=16"]
    assert t["value"] == pytest.approx(0.72 / 0.4) and t["passed"] is False


def test_auto_vs_fastest_takes_the_bench_s_back_to_back_ratio_when_it_covers_the_fastest():
    row = _row(16, 1.0, {"torch": {"seconds": 0.7, "precision": "strict"},
                         "torch-fast": {"seconds": 0.4, "precision": "fast"},
                         "auto": {"seconds": 0.9, "precision": "standard"}})
    row["auto_beside"] = {"torch": 1.01, "torch-fast": 1.9}  # torch-fast is not admitted: left out
    t = _by(gpu_check.evaluate_targets({"linear": [row]}), "auto_vs_fastest")["K=4096 N=4096 M=16"]
    assert t["value"] == pytest.approx(1.01) and t["passed"] and "timed beside auto: torch 1.010" in t["detail"]
    row["auto_beside"] = {"torch-fast": 1.9}  # the fastest admitted backend was not timed beside auto
    t = _by(gpu_check.evaluate_targets({"linear": [row]}), "auto_vs_fastest")["K=4096 N=4096 M=16"]
    assert t["value"] == pytest.approx(0.9 / 0.7) and "beside" not in t["detail"]
