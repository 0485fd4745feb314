"""The ``torch`` backends decline what ``torch._scaled_mm`` cannot do on this machine (issue 10).

torch 2.13.0+cpu raises for E4M3FNUZ operands on some machines (every shape on an AMX Xeon, M = N = 1
on one Zen 4 EPYC) and computes them on others (another Zen 4, Zen 3 and Zen 5 EPYCs, an Ice Lake Xeon):
not a function of the CPU design. The backends decide it with a trial call; these tests hold them to
"accept => compute within the bound, else decline with torch's message", on whatever CPU runs them.
"""

from __future__ import annotations

import pytest
import torch

import fp8ref
from fp8ref._machine import cpu_kind, cpu_model, cpu_signature
from fp8ref.conformance import check_contract
from fp8ref.conformance import strategies as fst
from fp8ref.kernels import torch_mm

ROCM = fp8ref.W8A8_FP8_ROCM  # E4M3FNUZ operands
SHAPES = [(1, 1, 16), (16, 16, 16)]


def _direct_scaled_mm_error(M: int, N: int, K: int) -> str | None:
    """torch._scaled_mm called directly (not through fp8ref) on E4M3FNUZ operands of this shape."""
    a = torch.zeros(M, K).to(torch.float8_e4m3fnuz)
    b = torch.zeros(N, K).to(torch.float8_e4m3fnuz)
    try:
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(M, 1), scale_b=torch.ones(1, N), out_dtype=torch.bfloat16)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", ["torch", "torch-fast"])
@pytest.mark.parametrize(("M", "N", "K"), SHAPES)
def test_fnuz_declines_with_torch_message_or_computes_within_bound(name, M, N, K):
    be = fp8ref.get_backend(name)
    torch_mm._TRIALS.clear()
    err = _direct_scaled_mm_error(M, N, K)
    reason = be.supports(fp8ref.Case(M, N, K, ROCM))
    a = fst.make_codes(fst.CodeSpec("bits", 1), M, K, ROCM.activation)
    b = fst.make_codes(fst.CodeSpec("bits", 2), N, K, ROCM.weight)
    if err is not None:
        assert reason is not None and " ".join(err.split())[:60] in reason, (reason, err)
        with pytest.raises(ValueError, match="raises on this machine"):
            be.scaled_mm(a, be.prepare_weight(b), None, torch.bfloat16)
        return
    assert reason is None, f"{cpu_model()} ({cpu_kind()}): torch._scaled_mm runs, yet {name} declines: {reason}"
    y = be.scaled_mm(a, be.prepare_weight(b), None, torch.bfloat16)
    y_ref = fp8ref.scaled_mm(a, b, out_dtype=torch.float64)
    bound = fp8ref.gemm_error_bound(a, b, out_dtype=torch.bfloat16, accumulation=be.accumulation,
                                    output_roundings=be.output_roundings, y_ref=y_ref)
    err_abs = (y.double() - y_ref).abs()
    assert bool((err_abs <= bound).all()), f"worst error/bound {float((err_abs / bound).max()):.3g}"


def _raise_for_fnuz(real):
    def fake(a, b, *args, **kwargs):
        if torch.float8_e4m3fnuz in (a.dtype, b.dtype):
            raise RuntimeError("itensor_view_from_dense expects float/bfloat16/half/int8/fp8 tensor "
                               "inputFloat8_e4m3fnuz")
        return real(a, b, *args, **kwargs)

    return fake


@pytest.mark.parametrize("name", ["torch", "torch-fast"])
def test_a_raising_scaled_mm_is_a_decline_everywhere(monkeypatch, name):
    """The decline path on every machine: torch._scaled_mm made to raise as it does on an AMX Xeon."""
    monkeypatch.setattr(torch, "_scaled_mm", _raise_for_fnuz(torch._scaled_mm))
    torch_mm._TRIALS.clear()
    try:
        be = fp8ref.get_backend(name)
        reason = be.supports(fp8ref.Case(1, 1, 16, ROCM))
        assert reason is not None and "itensor_view_from_dense" in reason and "e4m3fnuz" in reason
        assert be.supports(fp8ref.Case(1, 1, 16, fp8ref.W8A8_FP8)) is None
        # the conformance suite sees a decline (n/a), never an error
        pinned = fst.GemmProblem(1, 1, 16, ROCM, torch.bfloat16, fst.CodeSpec("bits", 6), fst.CodeSpec("bits", 7))
        from fp8ref.conformance.contracts import Declined, get_contract

        with pytest.raises(Declined, match="itensor_view_from_dense"):
            get_contract("scaled_mm.sign_symmetry").check(be, pinned)
        res = check_contract(be, "scaled_mm.sign_symmetry", "dev", seed=3)
        assert res.status in ("pass", "n/a") and not res.failed, res
    finally:
        torch_mm._TRIALS.clear()


def test_trial_is_cached_per_class(monkeypatch):
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    torch_mm._TRIALS.clear()
    be = fp8ref.get_backend("torch")
    for M in (5, 7, 64):  # all in the class M >= 3
        be.supports(fp8ref.Case(M, 32, 64, fp8ref.W8A8_FP8))
    assert len(calls) == 1
    be.supports(fp8ref.Case(1, 32, 64, fp8ref.W8A8_FP8))
    assert len(calls) == 2
    torch_mm._TRIALS.clear()


def _ledger_entry() -> dict:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "properties" / "known_failures.py"
    spec = importlib.util.spec_from_file_location("fp8ref_known_failures", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.known_failure("torch-cpu-scaled-mm-fnuz")


def _design_records(entry: dict, sig: dict) -> list[dict]:
    """The ledger's observations of machines of this CPU design (a record's None matches any value)."""
    keys = ("kind", "vendor", "family", "model")
    return [c for c in entry["cpus"] if all(c.get(k) is None or c[k] == sig.get(k) for k in keys)]


def _observed_raises(record: dict, M: int, N: int) -> bool:
    return record["raises"] == "every shape" or (record["raises"] == "M = N = 1" and M == N == 1)


def test_ledger_records_are_well_formed():
    entry = _ledger_entry()
    assert entry["cpus"], "the entry records no machine"
    for c in entry["cpus"]:
        assert set(c) == {"kind", "vendor", "family", "model", "raises", "seen"}, c
        assert c["raises"] in ("every shape", "M = N = 1", "never"), c
    # the two family-25 avx512_bf16 records disagree at M = N = 1: the reason the test below warns
    # instead of failing where a machine disagrees with its design's records
    zen4 = [c for c in entry["cpus"] if (c["kind"], c["family"]) == ("avx512_bf16", 25)]
    assert {_observed_raises(c, 1, 1) for c in zen4} == {True, False}


@pytest.mark.parametrize(("M", "N", "K"), SHAPES)
def test_upstream_fnuz_behaviour_on_this_cpu(M, N, K):
    """torch._scaled_mm called directly on E4M3FNUZ operands: where it raises, it raises the error the
    ledger entry torch-cpu-scaled-mm-fnuz records (and the backends decline with it: the test above);
    where it runs, its result is within the fp32-accumulation bound. Whether it raises is not a function
    of the CPU design (two Zen 4 EPYCs disagreed at M = N = 1), so this machine's behaviour is checked
    against its design's earlier records only by a warning, never a failure: a test that asserted the
    record made main red on the machine that disagreed."""
    if torch.__version__.split("+")[0] != "2.13.0":
        pytest.skip(f"the ledger records torch 2.13.0, this is {torch.__version__}")
    entry = _ledger_entry()
    sig = cpu_signature()
    err = _direct_scaled_mm_error(M, N, K)
    if err is not None:
        assert "itensor_view_from_dense" in err and "e4m3fnuz" in err.lower(), (
            f"{cpu_model()} ({sig}): torch._scaled_mm raises an error the ledger does not record: {err}")
    else:
        a = fst.make_codes(fst.CodeSpec("bits", 3), M, K, ROCM.activation)
        b = fst.make_codes(fst.CodeSpec("bits", 4), N, K, ROCM.weight)
        y = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale.float().reshape(M, 1),
                             scale_b=b.scale.float().reshape(1, N), out_dtype=torch.bfloat16)
        y_ref = fp8ref.scaled_mm(a, b, out_dtype=torch.float64)
        bound = fp8ref.gemm_error_bound(a, b, out_dtype=torch.bfloat16, y_ref=y_ref)
        worst = float(((y.double() - y_ref).abs() / bound).max())
        assert worst <= 1.0, f"torch._scaled_mm runs E4M3FNUZ here and misses the bound: worst error/bound {worst:.3g}"
    here = err is not None
    seen = _design_records(entry, sig)
    exact = [c for c in seen if c["model"] == sig.get("model")]
    if not exact or any(_observed_raises(c, M, N) != here for c in exact):
        import warnings

        warnings.warn(f"torch-cpu-scaled-mm-fnuz: on {cpu_model()} ({sig}) torch._scaled_mm "
                      f"{'raises' if here else 'runs'} at M={M}, N={N}, which no record of this machine "
                      f"says; the ledger's records of its design: {seen or 'none'} (add an observation)",
                      stacklevel=1)
