"""Issue 31: bounds that never read a number the backend returns, no false alarm on an input the spec
refuses, and counterexamples that replay to their exact tensors (the mutants that prove the suite
rejects wrong scales are in tests/mutants/scales.py)."""

import json
import subprocess
import sys

import pytest
import torch

from fp8ref import QuantScheme, Recipe, quantize
from fp8ref.cli import main as cli_main
from fp8ref.conformance import Declined, check, replay
from fp8ref.conformance import strategies as fst
from fp8ref.conformance.contracts.linear import check_linear_bound, check_linear_matches_two_calls
from fp8ref.conformance.problems import problem_from_dict, problem_to_dict
from fp8ref.conformance.profiles import PROFILES
from fp8ref.conformance.sweep import MAGNITUDES, corner_sweep
from fp8ref.spec.bounds import conforming_quantization_error_bound, scale_interval

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mutants.catalogue import Fp32Base, FusedTileLocalAmax  # noqa: E402

_SCHEMES = [QuantScheme(), QuantScheme(granularity="tensor", scale_dtype=torch.bfloat16),
            QuantScheme(granularity="group", group_size=16, scale_dtype=torch.float16),
            QuantScheme(format="e5m2", amax_floor=0.0, subnormal_scales=True)]


def _neighbours(s: torch.Tensor) -> list[torch.Tensor]:
    """s and its neighbours one step down and up in s's own dtype."""
    return [s, torch.nextafter(s, torch.zeros_like(s)), torch.nextafter(s, torch.full_like(s, torch.inf))]


@pytest.mark.parametrize("scheme", _SCHEMES, ids=lambda s: s.short_str())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_conforming_bound_holds_for_every_scale_the_scale_contract_admits(scheme, dtype):
    """A quantizer whose stored scale is the spec's or one step either side (inside scale_interval),
    dividing or multiplying by the reciprocal, stays within the bound computed from the spec's scale."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 48, generator=g, dtype=torch.float64) * torch.logspace(-4, 3, 48, dtype=torch.float64))
    x[2] = 0.0
    x = x.to(dtype)
    ref = quantize(x, scheme)
    lo, hi = scale_interval(ref)
    bound = conforming_quantization_error_bound(x, ref)
    for s in _neighbours(ref.scale):
        inside = (s.double() >= lo) & (s.double() <= hi)
        s = torch.where(inside, s, ref.scale)
        q = quantize(x, scheme.with_(dynamic=False), s)
        assert bool(((q.dequantize(torch.float64) - x.double()).abs() <= bound).all())


def test_conforming_bound_rejects_a_clipping_scale():
    """A scale half the spec's clips each row's largest value: outside the bound the spec's scale
    gives, although inside the bound the clipping scale would give itself."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    ref = quantize(x, QuantScheme())
    q = quantize(x, QuantScheme(dynamic=False), ref.scale / 2)
    err = (q.dequantize(torch.float64) - x.double()).abs()
    from fp8ref.spec.bounds import quantization_error_bound

    assert bool((err <= quantization_error_bound(x, q)).all())  # the backend's own scale excuses it
    assert not bool((err <= conforming_quantization_error_bound(x, ref)).all())  # the spec's does not


def test_a_linear_only_fused_kernel_with_a_tile_local_amax_fails_its_certificate():
    rep = check(FusedTileLocalAmax(), "ci", seed=0)
    assert rep.verdict == "fail" and rep.result("linear.bound").status == "fail"
    assert rep.result("linear.matches_two_calls").status == "not claimed"


def test_an_input_the_spec_refuses_is_declined_not_the_backends_fault():
    """amax 5e7 under an fp16 scale dtype: the spec raises "a scale overflows torch.float16" while
    building the bias that cancels row 0; the contract declines the example."""
    act = QuantScheme(granularity="tensor", scale_dtype=torch.float16)
    recipe = Recipe("fp16-scales", QuantScheme(), act)
    p = fst.LinearProblem(3, 4, 16, recipe, torch.float32, torch.float32, fst.TensorSpec("normal", 24, 1),
                          fst.TensorSpec("normal", 0, 2), True, "cancel")
    with pytest.raises(ValueError, match="overflows torch.float16"):
        p.build()
    for contract in (check_linear_bound, check_linear_matches_two_calls):
        with pytest.raises(Declined, match="spec refuses"):
            contract(Fp32Base(), p)


def test_magnitude_sweep_spans_every_input_dtype_exponent_range():
    probs = corner_sweep("quantize", PROFILES["ci"])
    for dtype, exps in MAGNITUDES.items():
        tiny = float(torch.finfo(dtype).smallest_normal) * 2.0 ** -{torch.float32: 23, torch.bfloat16: 7,
                                                                     torch.float16: 10}[dtype]
        assert 2.0 ** min(exps) <= tiny and 2.0 ** max(exps) >= float(torch.finfo(dtype).max) ** 0.5 / 2**10
        drawn = {p.x.exp for p in probs if p.x_dtype == dtype and not p.scheme.amax_floor}
        assert set(exps) <= drawn


def test_problems_round_trip_through_json():
    for op in ("quantize", "scaled_mm", "linear"):
        for p in corner_sweep(op, PROFILES["ci"])[::7]:
            assert problem_from_dict(json.loads(json.dumps(problem_to_dict(p)))) == p
    with pytest.raises(ValueError, match="not a serialized conformance problem"):
        problem_from_dict({"type": "Recipe"})


def test_replay_gives_the_exact_tensors_and_a_standalone_script(tmp_path):
    p = fst.QuantizeProblem(3, 40, torch.bfloat16, QuantScheme(granularity="group", group_size=16),
                            fst.TensorSpec("outliers", -2, 9))
    r = replay(json.dumps(problem_to_dict(p)))
    assert torch.equal(r.inputs["x"], p.build())
    ok, where = r.check(r.spec["codes"].float() * r.spec["scale"].float().repeat_interleave(16, dim=1)[:, :40])
    assert ok, where
    script = tmp_path / "repro.py"
    r.write_script(str(script))
    code = (f"import runpy, sys; g = runpy.run_path({str(script)!r}); assert 'fp8ref' not in sys.modules; "
            "s = g['SPEC']; y = s['codes'].float() * s['scale'].float().repeat_interleave(16, dim=1)[:, :40]; "
            "assert g['check'](y); assert not g['check'](y * 2); "
            "import torch; assert torch.equal(g['INPUTS']['x'], g['INPUTS']['x'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr


def test_cli_replays_a_counterexample(tmp_path, capsys):
    rep = check(FusedTileLocalAmax(), "ci", seed=0, contracts=["linear.bound"])
    r = rep.results[0]
    assert r.status == "fail" and r.problem is not None and "replay: fp8ref conformance --replay" in rep.to_text()
    out = tmp_path / "repro.py"
    assert cli_main(["conformance", "--replay", json.dumps(r.problem), "--write-script", str(out)]) == 0
    assert "counterexample: linear" in capsys.readouterr().out and out.exists()
    assert cli_main(["conformance", "--replay", "{not json"]) == 2
    assert cli_main(["conformance", "--write-script", str(out)]) == 2


@pytest.mark.parametrize("name", ["torch", "torch-fast"])
def test_torch_backends_keep_subnormal_bf16_outputs(name):
    """torch._scaled_mm (CPU) with tensor-wise scales flushes subnormal bf16 outputs on some CPUs
    (tests/findings/test_torch_scaled_mm_subnormal.py); the backends round the fp32 result once."""
    from fp8ref.registry import get_backend
    from fp8ref.spec.gemm import scaled_mm

    be = get_backend(name)
    if be.available() is not None:
        pytest.skip(be.available())
    a = torch.zeros(16, 32)
    a[0, 0] = 448.0
    scheme = QuantScheme(granularity="tensor", dynamic=False)
    qa = quantize(a, scheme, torch.tensor(2.0**-72))
    qb = quantize(a, scheme, torch.tensor(2.0**-72))  # y[0, 0] = 448 * 448 * 2**-144 ~ 2**-126.4: subnormal
    y = be.scaled_mm(qa, be.prepare_weight(qb), None, torch.bfloat16)
    want = scaled_mm(qa, qb, None, out_dtype=torch.bfloat16)
    assert want[0, 0].item() != 0 and torch.equal(y.view(torch.int16), want.view(torch.int16))
