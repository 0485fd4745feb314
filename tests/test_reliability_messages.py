"""Reliability, class 4: every bad input gets a clear error that blames the right argument (issue 13).

A catalogue of bad inputs is fed to every entry point that takes a caller's tensors: each
*registered* backend that is available here named explicitly, ``backend="auto"``, ``explain`` and
``reference_linear``. Each must raise the catalogue's exception type with a message that starts by
naming the offending argument, and must do so *before* any selection, probe or kernel: those are
replaced by functions that fail the test if reached. Then the other entry points: ``fp8ref select``
on the command line, the selection cache file, checkpoints, ``quantize_model``.
"""

from __future__ import annotations

import re

import pytest
import torch
from reliability_helpers import available, isolated  # noqa: F401 (isolated: an autouse fixture)
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import fp8ref
from fp8ref import select as sel
from fp8ref.cli import main
from fp8ref.registry import _REGISTRY
from fp8ref.select import selector
from fp8ref.spec import quant

K, N = 16, 8


def _nan(shape, at, value=float("nan"), dtype=torch.float32):
    t = torch.randn(*shape, dtype=dtype)
    t[at] = value
    return t


def _fp8(shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


def _per_tensor_weight():
    return fp8ref.quantize(torch.randn(N, K), fp8ref.FP8_PER_TENSOR.weight)


STATIC = fp8ref.Recipe("static", fp8ref.W8A8_FP8.weight, fp8ref.W8A8_FP8.activation.with_(dynamic=False))

#: (id, x, w, bias, keyword arguments, exception type, message pattern, entry points it applies to).
#: Every pattern starts with the argument it blames. Tensors are built lazily (each call gets fresh ones).
ALL = ("named", "auto", "explain", "reference_linear")
LINEAR = ("named", "auto")
CATALOGUE = [
    ("x-int", lambda: torch.ones(4, K, dtype=torch.int32), None, None, {}, TypeError,
     r"^x must have a float dtype .* got torch\.int32", ALL),
    ("x-fp8", lambda: _fp8((4, K)), None, None, {}, TypeError, r"^x is an FP8 tensor \(torch\.float8_e4m3fn\)", ALL),
    ("x-list", lambda: [[1.0] * K], None, None, {}, TypeError, r"^x must be a torch\.Tensor", ALL),
    ("x-0d", lambda: torch.tensor(1.0), None, None, {}, ValueError, r"^x must have at least one dim", ALL),
    ("x-nan", lambda: _nan((4, K), (1, 2)), None, None, {}, ValueError,
     r"^x contains 1 non-finite value\(s\) \(first: nan at index \(1, 2\)\)", ALL),
    ("x-inf-3d", lambda: _nan((2, 3, K), (1, 2, 5), float("-inf")), None, None, {}, ValueError,
     r"^x contains 1 non-finite value\(s\) \(first: -inf at index \(1, 2, 5\)\)", ALL),
    ("x-K", lambda: torch.randn(4, K + 1), None, None, {}, ValueError,
     rf"^x has {K + 1} features \(shape \(4, {K + 1}\)\) but w is \[{N}, {K}\]", ALL),
    ("w-nan", None, lambda: _nan((N, K), (2, 3)), None, {}, ValueError,
     r"^w contains 1 non-finite value\(s\) \(first: nan at index \(2, 3\)\)", ALL),
    ("w-inf", None, lambda: _nan((N, K), (0, 0), float("inf")), None, {}, ValueError, r"^w contains 1 non-finite", ALL),
    ("w-fp8", None, lambda: _fp8((N, K)), None, {}, TypeError, r"^w is an FP8 tensor \(torch\.float8_e4m3fn\) without "
                                                               r"its scales", ALL),
    ("w-int", None, lambda: torch.ones(N, K, dtype=torch.int64), None, {}, TypeError,
     r"^w must have a float dtype .* got torch\.int64", ALL),
    ("w-3d", None, lambda: torch.randn(2, N, K), None, {}, ValueError, r"^w must be 2-D \[N, K\]", ALL),
    ("w-list", None, lambda: [[1.0] * K] * N, None, {}, TypeError, r"^w must be a float torch\.Tensor \[N, K\] or an "
                                                                    r"fp8ref\.Quantized", ALL),
    ("w-K0", lambda: torch.randn(4, 0), lambda: torch.randn(N, 0), None, {}, ValueError,
     r"^w has 0 columns: the reduction dim K must be at least 1", ALL),
    ("w-scheme", None, _per_tensor_weight, None, {}, ValueError,
     r"^w was quantized as e4m3fn-tensor-dyn.*, recipe w8a8_fp8 expects", ALL),
    ("bias-shape", None, None, lambda: torch.randn(N + 1), {}, ValueError,
     rf"^bias must have shape \({N},\) = \[N\], got \({N + 1},\)", ALL),
    ("bias-2d", None, None, lambda: torch.randn(1, N), {}, ValueError, r"^bias must have shape", ALL),
    ("bias-int", None, None, lambda: torch.ones(N, dtype=torch.int32), {}, TypeError,
     r"^bias must have a float dtype, got torch\.int32", ALL),
    ("bias-fp8", None, None, lambda: _fp8((N,)), {}, TypeError, r"^bias must have a float dtype, got torch\.float8",
     ALL),
    ("bias-list", None, None, lambda: [0.0] * N, {}, TypeError, r"^bias must be a float torch\.Tensor \[N\] or None",
     ALL),
    ("bias-nan", None, None, lambda: _nan((N,), 4), {}, ValueError,
     r"^bias contains 1 non-finite value\(s\) \(first: nan at index \(4,\)\)", ALL),
    # meta tensors: a NaN scan of x called .item() on them ("Tensor.item() cannot be called on meta tensors")
    ("x-meta", lambda: torch.randn(4, K, device="meta"), None, None, {}, ValueError,
     r"^x is on the meta device, which holds no values", ALL),
    ("w-meta", None, lambda: torch.randn(N, K, device="meta"), None, {}, ValueError,
     r"^w is on the meta device, which holds no values", ALL),
    ("bias-meta", None, None, lambda: torch.randn(N, device="meta"), {}, ValueError,
     r"^bias is on the meta device, which holds no values", ALL),
    ("out-int32", None, None, None, {"out_dtype": torch.int32}, TypeError,
     r"^out_dtype must be one of .* got torch\.int32", ALL),
    ("out-fp8", None, None, None, {"out_dtype": torch.float8_e4m3fn}, TypeError, r"^out_dtype must be one of", ALL),
    ("recipe", None, None, None, {"recipe": "w8a8_nope"}, ValueError, r"^unknown recipe 'w8a8_nope'", ALL),
    ("precision", None, None, None, {"precision": "exactish"}, ValueError,
     r"^precision must be one of \['exact', 'strict', 'standard', 'fast'\]", ("named", "auto", "explain")),
    ("precision-type", None, None, None, {"precision": 3}, TypeError, r"^precision must be a str", LINEAR),
    ("backend-type", None, None, None, {"backend": ["cpu-fp32"]}, TypeError, r"^backend must be a backend name",
     ("auto",)),
    ("backend-name", None, None, None, {"backend": "cpu-fp33"}, fp8ref.BackendUnavailableError,
     r"^backend='cpu-fp33': \"?no backend named 'cpu-fp33'", ("auto",)),
    ("static-recipe", None, None, None, {"recipe": STATIC}, ValueError, r"^recipe 'static' has a static activation",
     LINEAR),
]


@pytest.fixture()
def nothing_may_run(monkeypatch):
    """Selection (probe and timing) and every backend method fail the test if reached."""

    def reached(*args, **kwargs):
        raise AssertionError("reached a selection, probe or kernel before the caller's input was checked")

    monkeypatch.setattr(selector, "_run_selection", reached)
    for b in list(_REGISTRY.values()):
        for method in ("quantize", "scaled_mm", "linear", "prepare_weight"):
            monkeypatch.setattr(b, method, reached)


def _entry_points():
    names = available()
    out = [("named", n) for n in names] + [("auto", "auto"), ("explain", None), ("reference_linear", None)]
    return out


def _call(kind, name, x, w, bias, kw):
    if kind in ("named", "auto"):
        kw = {"precision": "fast" if kind == "named" else "standard", **kw}
        if kind == "named":
            kw.setdefault("backend", name)
        return fp8ref.linear(x, w, bias, **kw)
    if kind == "explain":
        return fp8ref.explain(x, w, bias, **kw)
    return fp8ref.reference_linear(x, w, bias, **kw)


#: Every catalogue row at every entry point it applies to.
COMBOS = [(case, kind, name) for case in CATALOGUE for kind, name in _entry_points() if kind in case[7]]


@pytest.mark.parametrize("case, kind, name", COMBOS,
                         ids=[f"{c[0]}-{name if kind == 'named' else kind}" for c, kind, name in COMBOS])
def test_bad_input_blames_the_argument_before_anything_runs(nothing_may_run, case, kind, name):
    cid, mx, mw, mb, kw, exc, pattern, where = case
    x = mx() if mx else torch.randn(4, K)
    w = mw() if mw else torch.randn(N, K)
    bias = mb() if mb else None
    with pytest.raises(exc) as info:
        _call(kind, name, x, w, bias, dict(kw))
    assert re.search(pattern, str(info.value)), f"{cid} via {kind} {name or ''}: {info.value}"


def test_the_catalogue_reaches_every_backend():
    """The guard above is real: without it a kernel would run (here, a valid call does run one)."""
    assert {"cpu-bf16", "cpu-fp32", "reference", "torch"} <= set(available())
    y = fp8ref.linear(torch.randn(4, K), torch.randn(N, K), backend="cpu-fp32")
    assert y.shape == (4, N)


def test_nothing_may_run_guard_catches_a_kernel(nothing_may_run):
    with pytest.raises(AssertionError, match="before the caller's input was checked"):
        fp8ref.linear(torch.randn(4, K), torch.randn(N, K), backend="cpu-fp32")
    with pytest.raises(AssertionError, match="before the caller's input was checked"):
        fp8ref.explain(torch.randn(4, K), torch.randn(N, K))


def test_x_dtypes_are_the_reference_quantizers_inputs():
    assert set(sel.X_DTYPES) == set(quant._FLOAT_INPUTS)


@pytest.mark.parametrize("field, value, exc, pattern", [
    ("M", -1, ValueError, r"Case\.M must be an int >= 0, got -1"),
    ("N", -2, ValueError, r"Case\.N must be an int >= 0, got -2"),
    ("K", 0, ValueError, r"Case\.K must be an int >= 1, got 0"),
    ("K", 2.5, ValueError, r"Case\.K must be an int >= 1, got 2\.5"),
    ("x_dtype", torch.int32, TypeError, r"Case\.x_dtype must be one of .* got torch\.int32"),
    ("x_dtype", torch.float8_e4m3fn, TypeError, r"Case\.x_dtype must be one of"),
    ("out_dtype", torch.int8, TypeError, r"Case\.out_dtype must be one of .* got torch\.int8"),
    ("recipe", "w8a8_fp8", TypeError, r"Case\.recipe must be an fp8ref\.Recipe, got str"),
    # a device this machine lacks failed inside torch ("Torch not compiled with CUDA enabled")
    ("device", "cuda:99", ValueError, r"Case\.device is 'cuda:99', but (torch\.cuda\.is_available\(\) is False|this "
                                      r"machine has \d+ cuda device)"),
    ("device", "gpu0", ValueError, r"Case\.device must be a torch device string, got 'gpu0'"),
    ("device", "meta", ValueError, r"Case\.device is 'meta', which holds no values"),
])
def test_select_and_resolve_check_the_case(nothing_may_run, field, value, exc, pattern):
    args = {"M": 4, "N": N, "K": K, "recipe": fp8ref.W8A8_FP8, field: value}
    case = fp8ref.Case(**args)
    for call in (sel.select, sel.resolve):
        with pytest.raises(exc, match=pattern):
            call(case)


class TakesThreeRows(fp8ref.Backend):
    """Declines more than 3 rows: M = 3 shares its bucket (3..4) with M = 4."""

    name = "t-three-rows"
    accumulation = fp8ref.Accumulation.FP32

    def supports(self, case):
        return "more than 3 rows" if case.M > 3 else None

    def quantize(self, x, scheme):
        return fp8ref.quantize(x, scheme)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp8ref.scaled_mm(a, b, bias, out_dtype=out_dtype)


def test_named_backend_decline_names_the_callers_case():
    """The decline of a named backend names the caller's M (it once named the bucket's other end:
    "does not support M3-..." for a call with M = 4), and says where in the bucket it declined."""
    fp8ref.register_backend(TakesThreeRows(), replace=True)
    try:
        with pytest.raises(fp8ref.BackendUnavailableError,
                           match=r"backend 't-three-rows' does not support M3-N8-K16-w8a8_fp8-float32-float32-cpu: "
                                 r"more than 3 rows \(at M=4: one decision serves M=3\.\.4\)$"):
            fp8ref.linear(torch.randn(3, K), torch.randn(N, K), backend="t-three-rows")
        with pytest.raises(fp8ref.BackendUnavailableError, match=r"does not support M5-N8-K16-\S+: more than 3 rows$"):
            fp8ref.linear(torch.randn(5, K), torch.randn(N, K), backend="t-three-rows")
    finally:
        fp8ref.unregister_backend("t-three-rows")


# -- fp8ref select on the command line -----------------------------------------------------------

def _cli(capsys, *args) -> tuple[int, str]:
    """``fp8ref select ARGS`` in this process: (exit status, stderr). argparse exits with 2."""
    try:
        rc = main(["select", *args])
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("args, pattern", [
    (["--M", "4", "--N", "8", "--K", "0"], r"argument --K: must be >= 1, got 0 \(the reduction dim K must be at "
                                           r"least 1\)"),
    (["--M", "4", "--N", "-1", "--K", "16"], r"argument --N: must be >= 0, got -1"),
    (["--M", "-3", "--N", "8", "--K", "16"], r"argument --M: must be >= 0, got -3"),
    (["--M", "four", "--N", "8", "--K", "16"], r"argument --M: expected an integer, got 'four'"),
    (["--M", "4", "--N", "8", "--K", "16", "--device", "gpu0"], r"argument --device: .*gpu0"),
    (["--M", "4", "--N", "8", "--K", "16", "--device", "cuda:99"], r"fp8ref select: error: Case\.device is 'cuda:99'"),
    (["--M", "4", "--N", "8", "--K", "16", "--candidates", "cpu-fp33"], r"fp8ref select: error: no backend named "
                                                                         r"'cpu-fp33'"),
])
def test_cli_select_rejects_bad_options_without_a_traceback(capsys, args, pattern):
    """An exception escaping ``main`` would be the traceback the user saw; a usage error instead."""
    rc, err = _cli(capsys, *args)
    assert rc == 2 and re.search(pattern, err), (rc, err)


# -- Output files of long commands ---------------------------------------------------------------

def _must_not_run(*args, **kwargs):
    raise AssertionError("the command started its work before checking where its result goes")


@pytest.mark.parametrize("argv, option", [
    (["bench", "--sections", "quant", "--json", "{bad}"], "--json"),
    (["conformance", "--backend", "reference", "--json", "{bad}"], "--json"),
    (["conformance", "--backend", "reference", "--markdown", "{bad}"], "--markdown"),
    (["certify", "--peer", "onnxruntime-qdq", "--json", "{bad}"], "--json"),
    (["certify", "--peer", "onnxruntime-qdq", "--output", "{bad}"], "--output"),
], ids=lambda v: v if isinstance(v, str) else "-".join(a for a in v if a != "{bad}"))
def test_unwritable_output_is_refused_before_the_work(tmp_path, monkeypatch, capsys, argv, option):
    """An output file that cannot be written (here: under a regular file) was a traceback after the
    whole run (minutes of benchmarking or certifying lost); now exit status 2 before any of it."""
    pytest.importorskip("hypothesis")
    import fp8ref.bench
    import fp8ref.conformance
    from fp8ref.cli import certify

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # certify sets it if unset; restored after the test
    monkeypatch.setattr(fp8ref.bench, "run", _must_not_run)
    monkeypatch.setattr(fp8ref.conformance, "check", _must_not_run)
    monkeypatch.setattr(certify, "_certify_one", _must_not_run)
    monkeypatch.setattr(certify, "_via_subprocess", _must_not_run)
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "out.json"
    rc = main([str(bad) if a == "{bad}" else a for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(rf"^fp8ref {argv[0]}: {option}: cannot write {re.escape(str(bad))}: "
                                 rf"{re.escape(str(bad.parent))} is not a directory$",
                                 err, re.M), err


# -- The selection cache file --------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"\xff\xfe\x00not utf-8 \xc3\x28", b'{"schema": 1, "entries": {"k": "\xe9"}}'],
                         ids=["binary", "latin-1"])
def test_non_utf8_cache_is_ignored_with_a_warning(content):
    path = sel.cache_file()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    case = fp8ref.Case(M=4, N=N, K=K, recipe=fp8ref.W8A8_FP8)
    with pytest.warns(UserWarning, match="ignoring corrupt selection cache .*utf-8"):
        d = sel.select(case, candidates=["reference"])
    assert d.source == "probe"
    sel.clear_cache()
    assert sel.select(case, candidates=["reference"]).source == "disk"  # rewritten as valid JSON


def test_malformed_cache_entry_is_ignored_with_a_warning():
    case = fp8ref.Case(M=4, N=N, K=K, recipe=fp8ref.W8A8_FP8)
    d = sel.select(case, candidates=["reference"])
    path = sel.cache_file()
    path.write_text(path.read_text().replace('"rows": [', '"rows": ["not a row", '))
    sel.clear_cache()
    with pytest.warns(UserWarning, match="ignoring malformed cache entry"):
        assert sel.select(case, candidates=["reference"]).chosen == d.chosen


# -- Checkpoints ---------------------------------------------------------------------------------

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, K)
        self.proj = nn.Linear(K, N)
        self.out = nn.Linear(N, 4)


def _saved(tmp_path, **changes):
    torch.manual_seed(0)
    m = Two()
    fp8ref.quantize_model(m, skip=(), backend="reference")
    good = tmp_path / "good.safetensors"
    fp8ref.save_fp8_dynamic(m, good)
    if not changes:
        return good
    with safe_open(str(good), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors.update({k.replace("__", "."): v for k, v in changes.items()})
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    return bad


def _unchanged(model: nn.Module, before: dict) -> bool:
    return (all(type(mod) is not fp8ref.Fp8Linear for mod in model.modules())
            and all(torch.equal(v, before[k]) for k, v in model.state_dict().items()))


@pytest.mark.parametrize("changes, pattern", [
    ({"out__bias": torch.zeros(5)}, r"^out\.bias has shape \(5,\), layer 'out' needs \[4\]"),
    ({"out__bias": torch.zeros(4, dtype=torch.int32)}, r"^out\.bias has dtype torch\.int32"),
    ({"out__bias": torch.tensor([0.0, float("inf"), 0.0, 0.0])},
     r"^out\.bias contains 1 non-finite value\(s\) \(first: inf at index \(1,\)\)"),
    ({"embed__weight": torch.zeros(9, K)}, r"embed\.weight has shape \(9, 16\), the model's is \(8, 16\)"),
])
def test_checkpoint_errors_name_the_tensor_and_change_nothing(tmp_path, changes, pattern):
    bad = _saved(tmp_path, **changes)
    model = Two()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fp8ref.CheckpointError, match=pattern):
        fp8ref.load_fp8_dynamic(model, bad)
    assert _unchanged(model, before)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_unreadable_checkpoint_names_the_file(tmp_path, damage):
    good = _saved(tmp_path)
    data = good.read_bytes()
    bad = tmp_path / f"{damage}.safetensors"
    bad.write_bytes({"garbage": b"not a safetensors file" * 4, "truncated": data[: len(data) // 2],
                     "empty": b""}[damage])
    model = Two()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fp8ref.CheckpointError, match=re.escape(str(bad)) + ": not a readable safetensors file"):
        fp8ref.load_fp8_dynamic(model, bad)
    assert _unchanged(model, before)


def test_saving_onto_a_directory_names_it_and_writes_nothing(tmp_path):
    """It wrote the whole file into the parent folder, then failed to replace the directory with it
    (`IsADirectoryError: '/.tmp.1tb83fy7.tmp' -> '/tmp'`)."""
    model = Two()
    fp8ref.quantize_model(model, skip=(), backend="reference")
    target = tmp_path / "ckpt"
    target.mkdir()
    with pytest.raises(IsADirectoryError, match=re.escape(f"{target} is a directory, not a file to write")):
        fp8ref.save_fp8_dynamic(model, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and not any(target.iterdir())


def test_checkpoint_round_trip_still_loads(tmp_path):
    good = _saved(tmp_path)
    model = Two()
    assert fp8ref.load_fp8_dynamic(model, good, backend="reference") == ["proj", "out"]
    assert isinstance(model.proj, fp8ref.Fp8Linear) and isinstance(model.out, fp8ref.Fp8Linear)


# -- quantize_model ------------------------------------------------------------------------------

def test_quantize_model_names_the_layer_and_converts_all_or_nothing():
    model = nn.Sequential(nn.Linear(K, K), nn.ReLU(), nn.Linear(K, N), nn.ReLU(), nn.Linear(N, 4))
    with torch.no_grad():
        model[2].weight[3, 1] = float("inf")
    with pytest.raises(ValueError, match=r"^quantize_model: layer '2' cannot be quantized \(linear\.weight contains 1 "
                                         r"non-finite value\(s\) \(first: inf at index \(3, 1\)\).*\); the model is "
                                         r"left unchanged"):
        fp8ref.quantize_model(model, skip=())
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]


def test_quantize_model_names_a_bad_bias():
    model = nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(N, 4))
    with torch.no_grad():
        model[0].bias[2] = float("nan")
    with pytest.raises(ValueError, match=r"layer '0' cannot be quantized \(linear\.bias contains 1 non-finite"):
        fp8ref.quantize_model(model, skip=())
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
