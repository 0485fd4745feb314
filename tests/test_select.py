"""The compliance-gated selector: probe, precision classes, caches, forcing, run-time fallback."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import fp8ref
from fp8ref import select as sel
from fp8ref.registry import Backend, Case
from fp8ref.select import cache, timing

L = sys.modules["fp8ref.api"]  # fp8ref.linear is the function; the module lives here
CASE = Case(M=8, N=48, K=64, recipe=fp8ref.W8A8_FP8)


class _Clock:
    """The selector's clock in these tests: real time plus the fake backends' simulated delays.

    A fake backend's delay is added to the clock instead of slept, so "t-slower takes 0.4 s more"
    holds exactly however loaded the machine is, at no cost in wall time; the delays are chosen
    far above the fakes' real work, which still counts and which a loaded 2-core machine
    stretches to tens of milliseconds (1 ms vs 3 ms delays once lost to that noise).
    """

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    def sleep(self, seconds: float) -> None:
        self.offset += seconds


CLOCK = _Clock()


class Good(Backend):
    """Correct: reference quantizer, fp32 dequantize-then-matmul (strict class), optional delay."""

    accumulation = fp8ref.Accumulation.FP32
    output_roundings = 1

    def __init__(self, name, delay=0.0, output_roundings=1):
        self.name, self.delay, self.output_roundings = name, delay, output_roundings
        self.calls = {"quantize": 0, "scaled_mm": 0, "prepare_weight": 0}
        self.broken = False

    def quantize(self, x, scheme):
        self.calls["quantize"] += 1
        return fp8ref.quantize(x, scheme)

    def prepare_weight(self, w):
        self.calls["prepare_weight"] += 1
        return w

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        self.calls["scaled_mm"] += 1
        if self.broken:
            raise RuntimeError("simulated kernel launch failure")
        if self.delay:
            CLOCK.sleep(self.delay)
        y = a.dequantize(torch.float32) @ b.dequantize(torch.float32).T
        if self.output_roundings == 2:
            y = y.to(out_dtype).to(torch.float32)
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(out_dtype)


class ScaleTwice(Good):
    """sglang PR#28333: the activation scale applied twice. Instant, and wrong."""

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = super().scaled_mm(a, b, bias, torch.float32)
        return (y * a.scale.to(torch.float32)).to(out_dtype)


class NanOnZeroRow(Good):
    """pytorch/ao#4713: an all-zero row gets scale 0, so 0/0 = NaN codes."""

    def quantize(self, x, scheme):
        q = fp8ref.quantize(x, scheme)
        amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
        s = amax / scheme.qmax
        data = (x.to(torch.float32) / s).clamp(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype)
        return fp8ref.Quantized(data, s, q.scheme)


class Unavailable(Good):
    def available(self):
        return "needs a device this machine lacks"


@pytest.fixture()
def fakes(tmp_path, monkeypatch):
    """Register fake backends in an isolated cache dir; remove them afterwards."""
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(timing, "clock", CLOCK.perf_counter)
    monkeypatch.delenv(sel.ENV_BACKEND, raising=False)
    monkeypatch.delenv(sel.ENV_CANDIDATES, raising=False)
    sel.clear_cache()
    made = {
        "good": Good("t-good"),
        "slow": Good("t-slow", delay=0.2),
        "twice": ScaleTwice("t-twice"),
        "nan": NanOnZeroRow("t-nan"),
        "std": Good("t-std", output_roundings=2),
        "off": Unavailable("t-off"),
    }
    for b in made.values():
        fp8ref.register_backend(b, replace=True)
    # One torch thread: the fakes' real work is a few tiny ops, which two threads on a loaded
    # 2-core machine turned into ~25 ms of spinning per call, drowning their simulated delays.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield made
    torch.set_num_threads(threads)
    for b in made.values():
        fp8ref.unregister_backend(b.name)
    sel.clear_cache()
    L.clear_weight_cache()


def _row(d, name):
    return next(r for r in d.rows if r.backend == name)


def test_m_bucket():
    assert [sel.m_bucket(m) for m in (0, 1, 2, 3, 4, 5, 16, 17, 4096)] == [1, 1, 2, 4, 4, 8, 16, 32, 4096]
    with pytest.raises(ValueError):
        sel.m_bucket(-1)


def test_reference_probe_compliant_on_every_recipe():
    for recipe in fp8ref.RECIPES.values():
        for has_bias in (False, True):
            c = Case(M=3, N=40, K=160, recipe=recipe, has_bias=has_bias)
            res = sel.probe(fp8ref.get_backend("reference"), c)
            assert res.compliant, (recipe.name, res)


def test_key_holds_what_changes_the_answer():
    ref = [fp8ref.get_backend("reference")]
    k = sel.selection_key(CASE, "standard", ref)
    for field in ("torch=", "triton=", "fp8ref=", "x=bfloat16", "out=bfloat16", "N=48", "K=64", "Mb=8",
                  "precision=standard", fp8ref.W8A8_FP8.short_str(), "cpu:"):
        assert field in k
    assert k == sel.selection_key(Case(M=5, N=48, K=64, recipe=fp8ref.W8A8_FP8), "standard", ref)
    assert k != sel.selection_key(Case(M=9, N=48, K=64, recipe=fp8ref.W8A8_FP8), "standard", ref)
    assert k != sel.selection_key(CASE, "strict", ref)
    assert k != sel.selection_key(Case(M=8, N=48, K=64, recipe=fp8ref.FP8_PER_TENSOR), "standard", ref)


def test_non_compliant_never_chosen_however_fast(fakes):
    d = sel.select(CASE, candidates=["t-twice", "t-slow", "t-nan"])
    assert d.chosen == "t-slow"
    twice, nan = _row(d, "t-twice"), _row(d, "t-nan")
    assert twice.compliant is False and twice.worst_ratio > 1 and "scaled_mm" in twice.detail
    assert nan.compliant is False and "quantize" in nan.detail
    assert "t-twice" not in d.ranking and "t-nan" not in d.ranking
    # alone with the reference, the broken backend still loses to the (untimed) spec
    assert sel.select(CASE, candidates=["t-twice"]).chosen == "reference"


def test_precision_requirement_excludes_standard_backend(fakes):
    d = sel.select(CASE, "strict", candidates=["t-std"])
    row = _row(d, "t-std")
    assert row.precision == "standard" and not row.admitted and row.compliant is None
    assert d.chosen == "reference"
    d2 = sel.select(CASE, "standard", candidates=["t-std"])
    assert d2.chosen == "t-std" and _row(d2, "t-std").compliant
    with pytest.raises(fp8ref.BackendUnavailableError, match="outside the required precision"):
        sel.resolve(CASE, "t-std", "strict")
    with pytest.raises(ValueError, match="precision must be one of"):
        sel.select(CASE, "sloppy")


def test_unavailable_listed_with_reason_and_never_chosen(fakes):
    d = sel.select(CASE, candidates=["t-off", "t-good"])
    assert _row(d, "t-off").available == "needs a device this machine lacks"
    assert d.chosen == "t-good"
    assert "unavailable: needs a device" in d.table()


def test_explicit_backend_that_cannot_run_raises(fakes, monkeypatch):
    with pytest.raises(fp8ref.BackendUnavailableError, match="not available here: needs a device"):
        sel.resolve(CASE, "t-off")
    with pytest.raises(fp8ref.BackendUnavailableError, match="no backend named"):
        sel.resolve(CASE, "no-such-backend")
    x, w = torch.randn(4, 64), torch.randn(48, 64)
    with pytest.raises(fp8ref.BackendUnavailableError):
        fp8ref.linear(x, w, backend="t-off")
    monkeypatch.setenv(sel.ENV_BACKEND, "t-off")
    with pytest.raises(fp8ref.BackendUnavailableError, match="FP8REF_BACKEND='t-off'"):
        fp8ref.linear(x, w)


def test_env_forces_backend(fakes, monkeypatch):
    x, w = torch.randn(4, 64), torch.randn(48, 64)
    monkeypatch.setenv(sel.ENV_BACKEND, "t-std")
    b, d = sel.resolve(CASE)
    assert b.name == "t-std" and d is None
    n = fakes["std"].calls["scaled_mm"]
    fp8ref.linear(x, w)
    assert fakes["std"].calls["scaled_mm"] == n + 1
    # an explicit argument wins over the environment
    assert sel.resolve(CASE, "reference")[0].name == "reference"


def test_runtime_failure_warns_once_and_falls_back(fakes, monkeypatch):
    monkeypatch.setenv(sel.ENV_CANDIDATES, "t-good,t-slow")
    x, w = torch.randn(4, 64), torch.randn(48, 64)
    y0 = fp8ref.linear(x, w)
    d = sel.select(Case(M=4, N=48, K=64, recipe=fp8ref.W8A8_FP8, x_dtype=torch.float32,
                        out_dtype=torch.float32))
    first, second = d.ranking[0], d.ranking[1]
    broken = fakes["good"] if first == "t-good" else fakes["slow"]
    broken.broken = True
    with pytest.warns(RuntimeWarning, match=f"{first}.*simulated kernel launch failure"):
        y1 = fp8ref.linear(x, w)
    assert torch.equal(y1, y0)  # both fakes run the same fp32 pipeline
    n = broken.calls["scaled_mm"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8ref.linear(x, w)  # no second warning, and the failed backend is not called again
    assert broken.calls["scaled_mm"] == n
    assert second in {"t-good", "t-slow", "reference"}
    # an explicitly named backend that raises propagates: no silent fallback
    with pytest.raises(RuntimeError, match="simulated"):
        fp8ref.linear(x, w, backend=broken.name)


def test_bad_input_is_not_blamed_on_the_backend(fakes, monkeypatch):
    monkeypatch.setenv(sel.ENV_CANDIDATES, "t-good")
    w = torch.randn(48, 64)
    fp8ref.linear(torch.randn(2, 64), w)
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fp8ref.linear(x, w)
    assert not cache._FAILED


def test_memory_then_disk_then_probe(fakes):
    d = sel.select(CASE, candidates=["t-good"])
    assert d.source == "probe" and sel.cache_file().is_file()
    assert sel.select(CASE, candidates=["t-good"]).source == "memory"
    probes = fakes["good"].calls["quantize"]
    sel.clear_cache()  # a fresh in-memory cache, as after a restart
    d2 = sel.select(CASE, candidates=["t-good"])
    assert d2.source == "disk" and d2.chosen == d.chosen and d2.ranking == d.ranking
    assert fakes["good"].calls["quantize"] == probes  # no probe ran
    assert sel.select(CASE, candidates=["t-good"], refresh=True).source == "probe"


def test_cache_survives_process_restart(tmp_path):
    env = dict(os.environ, **{sel.ENV_CACHE_DIR: str(tmp_path)})
    env.pop(sel.ENV_BACKEND, None)
    # the key holds the thread count: the child uses the parent's (which another test may have changed)
    code = (f"import torch; torch.set_num_threads({torch.get_num_threads()}); "
            "import fp8ref; from fp8ref import select as s; "
            "d = s.select(fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8), candidates=['reference']); "
            "print(d.source, d.chosen)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(fp8ref.__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    sel_here = sel.select  # the parent writes the cache, the child (a new process) reads it
    old = os.environ.get(sel.ENV_CACHE_DIR)
    os.environ[sel.ENV_CACHE_DIR] = str(tmp_path)
    try:
        sel.clear_cache()
        assert sel_here(Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8), candidates=["reference"]).source == "probe"
    finally:
        if old is None:
            os.environ.pop(sel.ENV_CACHE_DIR)
        else:
            os.environ[sel.ENV_CACHE_DIR] = old
        sel.clear_cache()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["disk", "reference"]


def test_corrupt_cache_ignored_and_rebuilt(fakes):
    path = sel.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": 1, "entries": {"trunc')
    with pytest.warns(UserWarning, match="corrupt selection cache"):
        d = sel.select(CASE, candidates=["t-good"])
    assert d.source == "probe"
    data = json.loads(path.read_text())
    assert d.key in data["entries"] and data["schema"] == sel.CACHE_SCHEMA


def test_stale_cache_ignored_and_rebuilt(fakes):
    path = sel.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": sel.CACHE_SCHEMA + 1, "fp8ref": "0.0.0", "entries": {"x": {}}}))
    with pytest.warns(UserWarning, match="stale selection cache"):
        d = sel.select(CASE, candidates=["t-good"])
    data = json.loads(path.read_text())
    assert data["schema"] == sel.CACHE_SCHEMA and list(data["entries"]) == [d.key]


def _writer(cache_dir: str, tag: str, n: int) -> None:
    os.environ[sel.ENV_CACHE_DIR] = cache_dir
    for i in range(n):
        d = sel.Decision(key=f"{tag}-{i}", case="c", precision="standard", chosen="reference",
                         ranking=["reference"], rows=[sel.Row("reference", "exact")])
        cache.write_disk(d.key, d)


def test_concurrent_writers_leave_valid_json(tmp_path):
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), tag, 25)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    data = json.loads((tmp_path / sel.cache_file().name).read_text())
    assert sorted(data["entries"]) == sorted(f"{t}-{i}" for t in "ab" for i in range(25))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_explain_table(fakes, capsys):
    x, w = torch.randn(5, 64), torch.randn(48, 64)
    os.environ[sel.ENV_CANDIDATES] = "t-good,t-twice,t-off"
    try:
        d = fp8ref.explain(x, w, print_table=True)
    finally:
        del os.environ[sel.ENV_CANDIDATES]
    out = capsys.readouterr().out
    for name in ("t-good", "t-twice", "t-off", "reference", "NON-COMPLIANT", "<==", "unavailable"):
        assert name in out
    assert d.chosen == "t-good"


def test_cli_select_and_backends(fakes, capsys):
    from fp8ref.cli import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "t-off" in out and "unavailable: needs a device this machine lacks" in out and "reference" in out
    assert main(["select", "--M", "4", "--N", "48", "--K", "64", "--candidates", "t-good,t-twice", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["chosen"] == "t-good" and d["source"] == "probe"
    assert {r["backend"]: r["compliant"] for r in d["rows"]} == {"t-good": True, "t-twice": False, "reference": True}
    assert main(["select", "--M", "4", "--N", "48", "--K", "64", "--candidates", "t-good,t-twice"]) == 0
    out = capsys.readouterr().out
    assert "source: memory" in out and "<==" in out


def test_runoff_reranks_contenders_timed_during_a_burst(fakes, monkeypatch):
    """A burst of load during the fast backend's sequential timing window (simulated: its
    sequential median reads 2x too slow) must not hand the decision to the slower one: the
    interleaved run-off re-times both under the same conditions."""
    fast, slow = Good("t-fast", delay=0.2), Good("t-slower", delay=0.6)
    for b in (fast, slow):
        fp8ref.register_backend(b, replace=True)
    # budgets in simulated seconds, so that both fakes get several timed runs (a single-run median
    # is not a contender) and a run-off of several rounds
    monkeypatch.setattr(timing, "TIME_BUDGET_S", 5.0)
    monkeypatch.setattr(timing, "RUNOFF_BUDGET_S", 10.0)
    real_time = timing.time_backend

    def bursty(b, case, best, timers=None):
        med, runs, note = real_time(b, case, best, timers)
        return (med * 4 if b.name == "t-fast" else med), runs, note

    monkeypatch.setattr(timing, "time_backend", bursty)
    try:
        d = sel.select(CASE, candidates=["t-fast", "t-slower"], refresh=True)
    finally:
        for b in (fast, slow):
            fp8ref.unregister_backend(b.name)
    assert d.chosen == "t-fast", d.table()
    assert "run-off" in _row(d, "t-fast").note and "run-off" in _row(d, "t-slower").note
    assert _row(d, "t-fast").median_s < _row(d, "t-slower").median_s


def test_runoff_skips_backends_far_behind(fakes, monkeypatch):
    fast, slow = Good("t-fast", delay=0.4), Good("t-slower", delay=1.1)  # 2.75x: fully timed, > RUNOFF_FACTOR
    for b in (fast, slow):
        fp8ref.register_backend(b, replace=True)
    monkeypatch.setattr(timing, "TIME_BUDGET_S", 10.0)  # several runs each: left out for the factor, not for one run
    try:
        d = sel.select(CASE, candidates=["t-fast", "t-slower"], refresh=True)
    finally:
        for b in (fast, slow):
            fp8ref.unregister_backend(b.name)
    assert d.chosen == "t-fast"
    assert _row(d, "t-slower").runs > 1 and "run-off" not in _row(d, "t-slower").note


def test_the_probe_runs_the_contracts(monkeypatch):
    """Every check of the probe is the conformance contract of that name (issue 33): the same
    function, except ``linear.bound``, which the contract runs through the api path (the probe
    cannot: it runs inside ``fp8ref.linear``'s selection) and ``linear.non_finite``, of which the
    probe runs the part ``rejects_non_finite`` promises."""
    from fp8ref.check import linear as core_linear
    from fp8ref.check.probe import PROBE_CHECKS
    from fp8ref.conformance.contracts import get_contract
    from fp8ref.conformance.contracts import linear as contract_linear

    names = [c.name for c in PROBE_CHECKS]
    assert {"quantize.scale", "quantize.codes", "scaled_mm.bound", "linear.bound"} <= set(names)
    for c in PROBE_CHECKS:
        contract = get_contract(c.name)
        assert contract.op == c.op
        if c.name not in ("linear.bound", "linear.non_finite"):
            assert contract.check is c.check, c.name
    assert c.check is not get_contract("linear.non_finite").check  # the declared part only
    seen = []
    monkeypatch.setattr(core_linear, "check_linear_bound", lambda b, p, call_linear: seen.append(call_linear) or 0.0)
    assert get_contract("linear.bound").check(None, None) == 0.0
    assert seen == [contract_linear.api_linear]


def test_the_probe_rejects_what_the_contract_rejects():
    """A backend the contracts' own check rejects fails the probe with that contract's name."""
    case = Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8)
    for bad, contract in ((ScaleTwice("t-twice"), "scaled_mm.bound"), (NanOnZeroRow("t-nan"), "quantize.")):
        res = sel.probe(bad, case)
        assert not res.compliant and res.detail.startswith(contract), res.detail
        assert res.worst_ratio > 1


def test_the_selector_runs_without_hypothesis(tmp_path):
    """The probe's checks live below the selector (``fp8ref.check``): ``backend="auto"`` needs
    no Hypothesis, which only the ``conformance`` extra installs."""
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import torch, fp8ref\n"
            "from fp8ref.select import probe\n"
            "case = fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8)\n"
            "assert probe(fp8ref.get_backend('torch'), case).compliant\n"
            "y = fp8ref.linear(torch.randn(4, 64), torch.randn(32, 64), backend='auto', candidates=['torch'])\n"
            "assert 'hypothesis' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n")
    env = {**os.environ, "PYTHONPATH": str(Path(fp8ref.__file__).parents[1]), sel.ENV_CACHE_DIR: str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_timing_times_the_bound_call_a_plan_runs():
    """The selector times what a plan's warm call runs: the bound call where the backend binds one
    (``Backend.bind_linear``), ``Backend.linear`` where it binds none or the bound call hands the
    case back, and ``linear`` alone where binding raises."""
    calls = []

    class Bound(fp8ref.get_backend("reference").__class__):
        name = "timing-bound"

        def __init__(self, hand_back=False, bind_raises=False):
            super().__init__()
            self.hand_back, self.bind_raises = hand_back, bind_raises

        def linear(self, *a, **k):
            calls.append("linear")
            return super().linear(*a, **k)

        def bind_linear(self, w, scheme, out_dtype):
            if self.bind_raises:
                raise RuntimeError("no bound call here")

            def run(x, bias):
                calls.append("bound")
                return None if self.hand_back else torch.zeros(x.shape[0], w.data.shape[0], dtype=out_dtype)

            return run

    case = Case(M=2, N=8, K=16, recipe=fp8ref.W8A8_FP8, x_dtype=torch.float32, out_dtype=torch.bfloat16,
                device="cpu", has_bias=True)
    for be, want in ((Bound(), ["bound"]), (Bound(hand_back=True), ["bound", "linear"]),
                     (Bound(bind_raises=True), ["linear"])):
        calls.clear()
        assert timing.timer(be, case)() >= 0
        assert calls == want, (be.hand_back, be.bind_raises, calls)


def test_the_probe_estimate_times_the_bound_call():
    """The probe's estimate (what lets the timing skip a backend) comes from the call a plan makes:
    a backend whose ``linear`` is slow but whose bound call is fast is estimated by the bound call."""
    from fp8ref.select.compliance import probe

    ref = fp8ref.get_backend("reference")

    class SlowLinear(type(ref)):
        name = "probe-slow-linear"

        def linear(self, *a, **k):
            time.sleep(0.005)
            return super().linear(*a, **k)

        def bind_linear(self, w, scheme, out_dtype):
            return lambda x, bias: type(ref).linear(self, x, w, bias, out_dtype, scheme)

    case = Case(M=4, N=8, K=32, recipe=fp8ref.W8A8_FP8, x_dtype=torch.float32, out_dtype=torch.bfloat16,
                device="cpu")
    res = probe(SlowLinear(), case)
    assert res.compliant, res.detail
    assert res.call_seconds < 0.005, res.call_seconds
