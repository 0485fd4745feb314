"""Every shipped backend against the spec: exact codes for quantize, the derived bound for the GEMM.

Tolerances come only from ``fp8ref.spec.bounds.gemm_error_bound`` with the backend's own declaration.
Backends that cannot run here are skipped with their reason; cases a backend declines are
skipped with the decline's reason (and the decline itself is tested in ``test_declines``).
"""

import doctest
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # run the triton backend in Triton's CPU interpreter

import pytest
import torch

import fp8ref
from fp8ref.registry import Case, get_backend
from fp8ref.spec import bounds, gemm, quant
from fp8ref.spec.schemes import FP8_BLOCK, FP8_PER_TENSOR, W8A8_FP8, W8A8_FP8_ROCM, QuantScheme, Recipe

SHIPPED = ["torch", "torch-fast", "cpu-bf16", "cpu-fp32", "cpu-fp8", "cpu-fp8-amx", "triton", "sgl-kernel",
           "sgl-kernel-block"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIXED = Recipe("mixed", QuantScheme(granularity="tensor"), QuantScheme(granularity="row"))
E5M2 = Recipe("e5m2", QuantScheme(format="e5m2"), QuantScheme(format="e5m2", granularity="tensor"))


def _backend(name):
    be = get_backend(name)
    reason = be.available()
    if reason:
        pytest.skip(f"{name} unavailable: {reason}")
    return be


def _case_or_skip(be, M, N, K, recipe, out_dtype=torch.bfloat16, has_bias=False, x_dtype=torch.bfloat16):
    case = Case(M, N, K, recipe, x_dtype=x_dtype, out_dtype=out_dtype, device=DEVICE, has_bias=has_bias)
    reason = be.supports(case)
    if reason:
        pytest.skip(f"{be.name} declines {case.short_str()}: {reason}")
    return case


def _activations(M, K, dtype, seed):
    """Random rows plus the awkward ones: all-zero, outlier, tiny (subnormal codes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    if M >= 4:
        x[1] = 0
        x[2] *= 1e3
        x[3] *= 1e-6
    return x.to(dtype).to(DEVICE)


def _ties_row(K):
    """A row with amax 448 (so the scale is 1) whose other entries sit exactly on E4M3 midpoints."""
    mids = torch.tensor([1.0625, 17.0, 2.0**-10, 3 * 2.0**-10, -5.0 * 2.0**-10, 304.0, -1.1875, 0.0])
    row = mids.repeat(-(-K // len(mids)))[:K].clone()
    row[0] = 448.0
    return row


def _assert_within(y, a, b, bias, out_dtype, be):
    y_ref, _ = gemm.scaled_mm_exact(a, b, bias)
    bound = bounds.gemm_error_bound(a, b, bias, out_dtype=out_dtype, accumulation=be.accumulation,
                                    output_roundings=be.output_roundings)
    assert y.dtype == out_dtype and tuple(y.shape) == tuple(y_ref.shape)
    y64 = y.to(torch.float64).cpu()
    err = (y64 - y_ref.cpu()).abs()
    assert bool(torch.isfinite(y64).all()), f"{be.name}: non-finite output"
    ratio = err / bound.cpu()
    idx = tuple(int(i) for i in torch.nonzero(ratio == ratio.max())[0])
    assert bool((err <= bound.cpu()).all()), (
        f"{be.name}: worst element {idx}: got {float(y64[idx])}, reference {float(y_ref[idx])}, "
        f"error {float(err[idx]):.3g} > bound {float(bound[idx]):.3g} (ratio {float(ratio[idx]):.3g})")


# ---------------------------------------------------------------- quantize: codes equal the spec's

QUANT_SCHEMES = {
    "row": QuantScheme(granularity="row"),
    "tensor": QuantScheme(granularity="tensor"),
    "group128": QuantScheme(granularity="group", group_size=128),
    "group32-floor0": QuantScheme(granularity="group", group_size=32, amax_floor=0.0),
    "row-e5m2": QuantScheme(format="e5m2"),
    "row-fnuz224": W8A8_FP8_ROCM.activation,
}


@pytest.mark.parametrize("scheme_id", list(QUANT_SCHEMES))
@pytest.mark.parametrize("name", SHIPPED)
def test_quantize_codes_equal_spec(name, scheme_id):
    be = _backend(name)
    scheme = QUANT_SCHEMES[scheme_id]
    for K, dtype in ((256, torch.bfloat16), (200, torch.float32)):
        x = _activations(6, K, dtype, seed=K)
        x[0] = _ties_row(K).to(dtype)
        try:
            q = be.quantize(x, scheme)
        except ValueError as exc:  # a kernel that does not do this scheme says so
            pytest.skip(f"{name} does not quantize {scheme.short_str()}: {exc}")
        r = quant.quantize(x.cpu(), scheme)
        codes, ref_codes = q.data.cpu().view(torch.uint8), r.data.view(torch.uint8)
        bad = (codes != ref_codes).nonzero()
        assert bad.numel() == 0, (f"{name} {scheme.short_str()} K={K} {dtype}: {bad.shape[0]} codes differ, "
                                  f"first at {tuple(bad[0].tolist())}: {int(codes[tuple(bad[0])])} vs "
                                  f"{int(ref_codes[tuple(bad[0])])}")
        assert torch.equal(q.scale.cpu(), r.scale), f"{name}: scales differ from the spec's"
        assert q.scheme == scheme


@pytest.mark.parametrize("name", SHIPPED)
def test_quantize_rejects_non_finite(name):
    be = _backend(name)
    for bad in (float("nan"), float("inf")):
        x = _activations(4, 64, torch.float32, seed=1)
        x[2, 5] = bad
        with pytest.raises(ValueError, match="non-finite"):
            be.quantize(x, QUANT_SCHEMES["row"])


# ---------------------------------------------------------------- scaled_mm: within the bound

GEMM_CASES = [
    # (M, N, K, recipe): aligned, K and N not multiples of 16, one row, block-scaled with a partial block
    (4, 32, 64, W8A8_FP8),
    (7, 40, 300, W8A8_FP8),
    (1, 9, 20, W8A8_FP8),
    (5, 24, 48, FP8_PER_TENSOR),
    (6, 17, 33, MIXED),
    (3, 160, 300, FP8_BLOCK),
    (4, 24, 40, W8A8_FP8_ROCM),
    (4, 24, 40, E5M2),
]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("M,N,K,recipe", GEMM_CASES, ids=[f"{c[3].name}-M{c[0]}N{c[1]}K{c[2]}" for c in GEMM_CASES])
@pytest.mark.parametrize("name", SHIPPED)
def test_scaled_mm_within_bound(name, M, N, K, recipe, out_dtype):
    be = _backend(name)
    _case_or_skip(be, M, N, K, recipe, out_dtype=out_dtype, has_bias=True)
    x = _activations(M, K, torch.bfloat16, seed=M * 1000 + K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N)).to(DEVICE)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    a = quant.quantize(x.cpu(), recipe.activation)
    b = quant.quantize(w.cpu(), recipe.weight)
    a_dev = quant.Quantized(a.data.to(DEVICE), a.scale.to(DEVICE), a.scheme, a.n_saturated)
    b_dev = quant.Quantized(b.data.to(DEVICE), b.scale.to(DEVICE), b.scheme, b.n_saturated)
    prepared = be.prepare_weight(b_dev)
    for weight, bb in ((prepared, bias), (b_dev, None)):  # prepared and plain weights, with/without bias
        y = be.scaled_mm(a_dev, weight, bb, out_dtype)
        _assert_within(y, a, b, None if bb is None else bb.cpu(), out_dtype, be)


@pytest.mark.parametrize("name", SHIPPED)
def test_prepared_weight_is_a_quantized(name):
    """prepare_weight's result still works with the spec (the selector's probes use it as b)."""
    be = _backend(name)
    _case_or_skip(be, 2, 16, 32, W8A8_FP8)
    b = quant.quantize(torch.randn(16, 32).to(DEVICE), W8A8_FP8.weight)
    p = be.prepare_weight(b)
    assert isinstance(p, quant.Quantized)
    a = quant.quantize(torch.randn(2, 32).to(DEVICE), W8A8_FP8.activation)
    assert torch.equal(gemm.scaled_mm(a, p), gemm.scaled_mm(a, b))


def test_torch_padding_path_matches_bound():
    """The CUDA padding path (K, N to multiples of 16), run on CPU with force_pad."""
    from fp8ref.kernels.torch_mm import TorchScaledMMBackend

    be = TorchScaledMMBackend("torch-padding-test")
    be.force_pad = True
    for M, N, K, recipe in ((3, 9, 20, W8A8_FP8), (2, 33, 17, FP8_PER_TENSOR)):
        a = quant.quantize(torch.randn(M, K), recipe.activation)
        b = quant.quantize(torch.randn(N, K), recipe.weight)
        p = be.prepare_weight(b)
        assert p.extra["b_op"].shape == (K + (-K) % 16, N + (-N) % 16)
        bias = torch.randn(N)
        _assert_within(be.scaled_mm(a, p, bias, torch.bfloat16), a, b, bias, torch.bfloat16, be)


def test_torch_bias_is_fused_before_the_single_rounding():
    """torch on CPU adds the bias before its one rounding: a.b = 257 and bias -256.5 give 0.5,
    where rounding 257 to bf16 first (256) would give -0.5. This justifies output_roundings=1."""
    tensor = QuantScheme(granularity="tensor")
    a_vals = torch.zeros(1, 16)
    a_vals[0, :2] = torch.tensor([256.0, 1.0])
    a = quant.Quantized(a_vals.to(torch.float8_e4m3fn), torch.ones(1, 1), tensor)
    b = quant.Quantized(torch.ones(16, 16).to(torch.float8_e4m3fn), torch.ones(1, 1), tensor)
    y = get_backend("torch").scaled_mm(a, b, torch.full((16,), -256.5), torch.bfloat16)
    assert float(y[0, 0]) == 0.5


def test_cpu_linear_fused_equals_quantize_then_mm():
    for name in ("cpu-bf16", "cpu-fp32"):
        be = get_backend(name)
        x = _activations(5, 96, torch.bfloat16, seed=3).cpu()
        b = be.prepare_weight(quant.quantize(torch.randn(24, 96), W8A8_FP8.weight))
        bias = torch.randn(24)
        fused = be.linear(x, b, bias, torch.bfloat16, W8A8_FP8.activation)
        split = be.scaled_mm(be.quantize(x, W8A8_FP8.activation), b, bias, torch.bfloat16)
        assert torch.equal(fused, split)


def test_cpu_fp32_bf16_dot_products_within_bound_and_restored():
    from fp8ref.kernels.cpu import CpuWideBackend

    be = CpuWideBackend("cpu-fp32-bf16dot", torch.float32, compile=False)
    be.bf16_dot_products = True
    mm = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    before = getattr(mm, "fp32_precision", None)
    a = quant.quantize(_activations(6, 160, torch.bfloat16, seed=5).cpu())
    b = quant.quantize(torch.randn(40, 160))
    bias = torch.randn(40)
    _assert_within(be.scaled_mm(a, be.prepare_weight(b), bias, torch.float32), a, b, bias, torch.float32, be)
    assert getattr(mm, "fp32_precision", None) == before


def _int_operands(M, K, N, seed):
    """FP8 codes of small integers with unit scales: every partial sum is an exact fp32 integer, so
    any summation order (oneDNN's packed GEMM, F.linear) gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    tensor = QuantScheme(granularity="tensor")
    a = quant.Quantized(torch.randint(-8, 9, (M, K), generator=g).float().to(torch.float8_e4m3fn),
                        torch.ones(1, 1), tensor)
    b = quant.Quantized(torch.randint(-8, 9, (N, K), generator=g).float().to(torch.float8_e4m3fn),
                        torch.ones(1, 1), tensor)
    return a, b


@pytest.mark.parametrize("name", ["cpu-bf16", "cpu-fp32"])
def test_cpu_packed_weight_equals_plain(name, monkeypatch):
    """Where oneDNN packing works here, a one-K-block weight is prepared packed (and no plain copy is
    kept), block weights stay plain, and the packed GEMM gives the plain one's bits on exact operands."""
    import copy

    from fp8ref.kernels import cpu

    be = get_backend(name)
    reason = cpu.pack_reason(be.wide)
    if reason is not None:
        pytest.skip(f"no oneDNN packing on this machine: {reason}")
    plain = cpu.CpuWideBackend(name, be.wide, compile=False)
    monkeypatch.setattr(plain, "prepare_weight", lambda w: cpu.PreparedWeight.wrap(w, name, wide=w.data.to(be.wide)))
    for M, K, N in [(1, 16, 16), (5, 96, 24), (33, 200, 70)]:
        a, b = _int_operands(M, K, N, seed=M)
        pb = be.prepare_weight(b)
        assert set(pb.extra) == {"packed"}
        bias = torch.arange(N, dtype=torch.float32)
        got, want = be.scaled_mm(a, pb, bias), plain.scaled_mm(a, plain.prepare_weight(b), bias)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        exact = a.data.float() @ b.data.float().T  # integers below 2**24: exact in fp32
        if be.output_roundings == 2:  # cpu-bf16: the GEMM's own bf16 rounding, then the epilogue's
            exact = exact.to(torch.bfloat16).float()
        assert torch.equal(got.float(), (exact + bias).to(torch.bfloat16).float())
        assert copy.deepcopy(pb).extra["packed"] is pb.extra["packed"]  # opaque: shared, never copied
    blocky = quant.quantize(torch.randn(256, 256), FP8_BLOCK.weight)
    assert set(be.prepare_weight(blocky).extra) == {"wide"}
    # A per-group activation needs the weight by K-segment: the packed one is widened plain for it.
    x = _activations(4, 256, torch.bfloat16, seed=9).cpu()
    a = quant.quantize(x, QuantScheme(granularity="group", group_size=128))
    w = quant.quantize(torch.randn(48, 256), W8A8_FP8.weight)
    got, want = be.scaled_mm(a, be.prepare_weight(w)), plain.scaled_mm(a, plain.prepare_weight(w))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_cpu_pack_refused_by_onednn_keeps_the_plain_weight(monkeypatch):
    """A reorder that raises for a weight (a shape oneDNN refuses on some machine) is no crash: the
    weight stays plain and computes the same bits."""
    from fp8ref.kernels import cpu

    be = get_backend("cpu-bf16")
    w = quant.quantize(torch.randn(8, 32), W8A8_FP8.weight)
    x = _activations(3, 32, torch.bfloat16, seed=1).cpu()
    monkeypatch.setattr(cpu, "_PACK_REASON", {torch.bfloat16: "off for this test"})
    plain = be.prepare_weight(w)
    assert set(plain.extra) == {"wide"}

    def refuse(*args, **kwargs):
        raise RuntimeError("oneDNN: unsupported")

    monkeypatch.setattr(cpu, "_PACK_REASON", {torch.bfloat16: None})  # packing "works" here
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    pw = be.prepare_weight(w)
    assert set(pw.extra) == {"wide"}
    assert torch.equal(be.linear(x, pw).view(torch.int16), be.linear(x, plain).view(torch.int16))


def test_cpu_backends_version_names_packing_and_sources(monkeypatch):
    """The selector's cache key includes each backend's ``version``: a decision timed with packed
    weights (or on other C++ code) is not reused for plain ones."""
    from fp8ref.kernels import cpu, native
    from fp8ref.select.keys import selection_key

    be = get_backend("cpu-bf16")
    case = Case(4, 32, 32, W8A8_FP8)
    monkeypatch.setattr(cpu, "_PACK_REASON", {torch.bfloat16: None})
    on, key_on = be.version, selection_key(case, "standard", [be])
    monkeypatch.setattr(cpu, "_PACK_REASON", {torch.bfloat16: "off for this test"})
    off, key_off = be.version, selection_key(case, "standard", [be])
    assert on.startswith("pack=oneDNN/") and off.startswith("pack=off/") and key_on != key_off
    assert native.source_version() in on and native.source_version() in get_backend("cpu-fp8").version


def test_cpu_pack_off_switch(monkeypatch):
    from fp8ref.kernels import cpu

    monkeypatch.setattr(cpu, "_PACK_REASON", {})
    monkeypatch.setenv("FP8REF_CPU_PACK", "0")
    assert cpu.pack_reason(torch.bfloat16) == "FP8REF_CPU_PACK=0"
    pb = get_backend("cpu-bf16").prepare_weight(quant.quantize(torch.randn(8, 32), W8A8_FP8.weight))
    assert set(pb.extra) == {"wide"}


@pytest.mark.slow
def test_cpu_compiled_paths_equal_eager():
    """torch.compile'd quantization and epilogue give bit-identical results (first compile ~10 s)."""
    from fp8ref.kernels.cpu import CpuWideBackend

    eager, compiled = CpuWideBackend("e", torch.bfloat16, compile=False), CpuWideBackend("c", torch.bfloat16,
                                                                                          compile=True)
    b = quant.quantize(torch.randn(48, 256), W8A8_FP8.weight)
    pe, pc = eager.prepare_weight(b), compiled.prepare_weight(b)
    for M in (1, 7, 33):
        x = _activations(M, 256, torch.bfloat16, seed=M).cpu()
        x[-1] = _ties_row(256).to(torch.bfloat16)
        x = torch.cat([x, torch.randn(64, 256) * torch.rand(64, 1) * 100]).to(torch.bfloat16)
        qe, qc = eager.quantize(x, W8A8_FP8.activation), compiled.quantize(x, W8A8_FP8.activation)
        assert torch.equal(qe.data.view(torch.uint8), qc.data.view(torch.uint8))
        assert torch.equal(qe.scale, qc.scale)
        r = quant.quantize(x, W8A8_FP8.activation)
        assert torch.equal(qc.data.view(torch.uint8), r.data.view(torch.uint8))
        assert torch.equal(eager.linear(x, pe), compiled.linear(x, pc))
        assert torch.equal(eager.scaled_mm(qe, pe), compiled.scaled_mm(qc, pc))


# ---------------------------------------------------------------- declines and unavailability

@pytest.mark.parametrize("name,case,needle", [
    ("torch", Case(4, 256, 256, FP8_BLOCK), "block"),
    ("torch-fast", Case(4, 256, 256, FP8_BLOCK), "block"),
    ("cpu-bf16", Case(4, 32, 32, W8A8_FP8, out_dtype=torch.float32), "cpu-fp32"),
    ("cpu-bf16", Case(4, 32, 32, W8A8_FP8, device="cuda"), "CPU"),
    ("triton", Case(4, 32, 32, Recipe("e5", QuantScheme(format="e5m2"), QuantScheme(format="e5m2"))), "e4m3fn"),
    ("triton", Case(4, 256, 256, Recipe("g", QuantScheme(granularity="block", block=(128, 64)),
                                        QuantScheme(granularity="group", group_size=128))), "K-block"),
    ("sgl-kernel", Case(4, 32, 32, W8A8_FP8, device="cpu"), "CUDA"),
    ("cpu-fp8", Case(4, 256, 256, FP8_BLOCK), "per-row or per-tensor"),
    ("cpu-fp8", Case(1024, 32, 32, W8A8_FP8), "small-M"),
    ("sgl-kernel-block", Case(4, 200, 256, FP8_BLOCK, device="cuda"), "multiples of 128"),
])
def test_declines(name, case, needle):
    reason = get_backend(name).supports(case)
    assert isinstance(reason, str) and needle in reason, reason


def test_cpu_fp8_without_bf16_dot_declines_large_m():
    """Off the packed path, the limit is the path's own, and the reason names what is missing."""
    from fp8ref.kernels.cpu_fp8 import _PATH_MAX_M, CpuFp8Backend

    be = CpuFp8Backend()
    be.bf16_dot = False
    limit = _PATH_MAX_M[be._path()]
    reason = be.supports(Case(limit + 1, 32, 32, W8A8_FP8))
    assert isinstance(reason, str) and "small-M" in reason and be._path() in reason
    assert ("lacks" in reason) or ("bf16_dot is off" in reason)
    assert be.supports(Case(limit, 32, 32, W8A8_FP8)) is None


def _cpu_fp8_on(path):
    """cpu-fp8 forced onto one kernel path, or a skip naming the flags this CPU lacks for it."""
    from fp8ref._machine import cpu_flags, cpu_model
    from fp8ref.kernels.cpu_fp8 import PATH_FLAGS, CpuFp8Backend

    be = CpuFp8Backend()
    if be.available():
        pytest.skip(be.available())
    missing = [f for f in PATH_FLAGS[path] if f not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU ({cpu_model()}) lacks {', '.join(missing)}: the {path} path cannot run here")
    be.isa = path
    return be


PATHS = ["packed", "avx512", "avx2", "scalar"]


def test_cpu_fp8_packed_splits_rows_in_chunks(monkeypatch):
    """More rows than PACKED_ROWS: chunked calls give the bits of one call (rows are independent)."""
    from fp8ref.kernels import cpu_fp8

    be = _backend("cpu-fp8")
    if not be._packed():
        pytest.skip("no avx512_bf16: the packed path does not run")
    qw = be.prepare_weight(quant.quantize(torch.randn(24, 40), W8A8_FP8.weight))
    qa = quant.quantize(torch.randn(21, 40), W8A8_FP8.activation)
    bias = torch.randn(24)
    whole = be.scaled_mm(qa, qw, bias, out_dtype=torch.float32)
    monkeypatch.setattr(cpu_fp8, "PACKED_ROWS", 8)
    chunked = be.scaled_mm(qa, qw, bias, out_dtype=torch.float32)
    assert torch.equal(whole.view(torch.int32), chunked.view(torch.int32))


def test_scaled_mm_refuses_what_it_declines():
    a = quant.quantize(torch.randn(2, 256), FP8_BLOCK.activation)
    b = quant.quantize(torch.randn(128, 256), FP8_BLOCK.weight)
    with pytest.raises(ValueError, match="block"):
        get_backend("torch").scaled_mm(a, b)
    a, b = quant.quantize(torch.randn(2, 32)), quant.quantize(torch.randn(16, 32))
    with pytest.raises(ValueError, match="cpu-fp32"):
        get_backend("cpu-bf16").scaled_mm(a, b, out_dtype=torch.float32)


def test_unavailable_backends_give_reasons():
    infos = {i.name: i for i in fp8ref.registry.backends()}
    for name in SHIPPED:
        assert name in infos
        info = infos[name]
        assert info.available == (info.reason is None)
    if not torch.cuda.is_available():
        for name in ("sgl-kernel", "sgl-kernel-block"):
            assert not infos[name].available and "CUDA" in infos[name].reason


def test_triton_unavailable_without_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("with CUDA the triton backend does not need the interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = get_backend("triton").available()
    assert reason is not None and ("TRITON_INTERPRET" in reason or "triton" in reason)


def test_cpu_fp8_unbuilt_is_unavailable_with_instructions(monkeypatch, tmp_path):
    from fp8ref.kernels import cpu_fp8, native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("FP8REF_CPU_FP8", raising=False)
    native.reset()
    try:
        reason = cpu_fp8.CpuFp8Backend().available()
    finally:
        monkeypatch.undo()
        native.reset()
    assert reason is not None and ("python -m fp8ref.kernels.build" in reason or "needs" in reason)


@pytest.mark.parametrize("path", PATHS)
def test_cpu_fp8_decodes_every_code_exactly(path):
    """An identity on one side makes the kernel output the other side's decoded codes, exactly: all
    254 finite E4M3FN codes through both the vector decoding (weights) and the activation path."""
    be = _cpu_fp8_on(path)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 254 finite codes
    codes = torch.cat([codes, torch.zeros(2, dtype=torch.uint8)]).reshape(4, 64).view(torch.float8_e4m3fn)
    values = codes.to(torch.float32)
    eye = torch.eye(64).to(torch.float8_e4m3fn)
    tensor = QuantScheme(granularity="tensor")
    one = torch.ones(1, 1)
    vals = quant.Quantized(codes, one, tensor)
    ident = quant.Quantized(eye, one, tensor)
    assert torch.equal(be.scaled_mm(ident, vals, out_dtype=torch.float32), values.t())
    assert torch.equal(be.scaled_mm(vals, ident, out_dtype=torch.float32), values)


@pytest.mark.parametrize("path", PATHS)
def test_cpu_fp8_accumulates_with_round_to_nearest_even(path):
    """64 + m * 2**-18 (m/2 fp32 ulps of 64) must round to nearest even, as the declared fp32
    accumulation assumes (vdpbf16ps is specified so; truncation would give floor(m/2))."""
    be = _cpu_fp8_on(path)
    tensor, one = QuantScheme(granularity="tensor"), torch.ones(1, 1)
    for m, rne_ulps in ((3, 2), (5, 2), (7, 4)):  # 1.5 -> 2, 2.5 -> 2, 3.5 -> 4
        for big, small in ((1, 0), (0, 1)):  # both orders within a vdpbf16ps pair
            a, b = torch.zeros(1, 32), torch.zeros(1, 32)
            a[0, big] = b[0, big] = 8.0
            a[0, small], b[0, small] = m * 2.0**-9, 2.0**-9
            qa = quant.Quantized(a.to(torch.float8_e4m3fn), one, tensor)
            qb = quant.Quantized(b.to(torch.float8_e4m3fn), one, tensor)
            y = be.scaled_mm(qa, qb, out_dtype=torch.float32).item()
            assert y == 64.0 + rne_ulps * 2.0**-17, (m, big, y)


@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_cpu_fp8_unpacked_paths_within_fp32_bound(path):
    """Row counts across every register block (1..17, 33), N across column slices, K across the
    16-code steps and their scalar tails (77, 530), with bias."""
    be = _cpu_fp8_on(path)
    g = torch.Generator().manual_seed(5)
    for N, K in ((45, 77), (17, 530)):
        qw = quant.quantize(torch.randn(N, K, generator=g), W8A8_FP8.weight)
        w = be.prepare_weight(qw)
        bias = torch.randn(N, generator=g)
        for M in list(range(1, 18)) + [33]:
            qa = quant.quantize(torch.randn(M, K, generator=g) * 5, W8A8_FP8.activation)
            y = be.scaled_mm(qa, w, bias, out_dtype=torch.float32)
            ref = gemm.scaled_mm(qa, qw, bias, out_dtype=torch.float64)
            bound = bounds.gemm_error_bound(qa, qw, bias, out_dtype=torch.float32, accumulation=be.accumulation,
                                            output_roundings=be.output_roundings, y_ref=ref)
            assert bool(((y.to(torch.float64) - ref).abs() <= bound).all()), (path, M, N, K)


def test_cpu_fp8_refuses_nan_codes():
    be = _backend("cpu-fp8")
    b = quant.quantize(torch.randn(16, 32), W8A8_FP8.weight)
    bad = b.data.clone()
    bad.view(torch.uint8)[3, 4] = 0x7F
    with pytest.raises(ValueError, match="NaN codes"):
        be.prepare_weight(quant.Quantized(bad, b.scale, b.scheme))
    a = quant.quantize(torch.randn(2, 32), W8A8_FP8.activation)
    y = be.scaled_mm(a, be.prepare_weight(b))
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("mod", ["fp8ref.kernels._common", "fp8ref.kernels.torch_mm", "fp8ref.kernels.cpu",
                                 "fp8ref.kernels.cpu_fp8", "fp8ref.kernels.cpu_fp8_amx", "fp8ref.kernels.native",
                                 "fp8ref.kernels.triton_kernels", "fp8ref.kernels.sgl"])
def test_docstring_examples(mod):
    result = doctest.testmod(importlib.import_module(mod), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
