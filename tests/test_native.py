"""The compiled CPU extension's fused pieces against the spec, bit for bit.

``quant_blocks`` (dynamic quantization with tensor, row, group or block scales, to codes or to the
exact FP8 values in bf16/fp32, on each code path the CPU runs: scalar, AVX2, AVX-512),
``scale_epilogue`` (the CPU backends' fp32 scale-and-bias epilogue), the packed ``cpu-fp8`` GEMM
and ``Backend.linear`` — every one claims to compute the spec's expressions in the spec's order,
so each is compared for *equal bits* (quantization, epilogue) or against the derived fp32 bound
(GEMM, whose summation order is its own). Skipped with the reason when the extension is not built
(``python -m fp8ref.kernels.build``; ``fp8ref.kernels.native`` loads it).
"""

import math

import pytest
import torch

import fp8ref
from fp8ref._machine import cpu_model
from fp8ref.kernels import _common, cpu, cpu_fp8, native
from fp8ref.spec import bounds, gemm, quant
from fp8ref.spec.formats import E4M3FN, E4M3FNUZ, E5M2
from fp8ref.spec.schemes import QuantScheme


@pytest.fixture(scope="module")
def mod():
    native.reset()
    m = native.get()
    if m is None:
        pytest.skip(cpu_fp8.CpuFp8Backend().available() or "FP8REF_NATIVE=0")
    return m


FORMATS = {"e4m3fn": E4M3FN, "e5m2": E5M2, "e4m3fnuz": E4M3FNUZ}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(fmt, dtype, seed):
    """Rows that exercise every rounding path: exact ties of the FP8 grid (both parities), the
    subnormal range and its boundary, saturation at +-qmax, zeros and -0, a zero row, a huge
    dynamic range, and an odd K (vector body plus scalar tail)."""
    g = torch.Generator().manual_seed(seed)
    K = 203
    rows = [torch.randn(K, generator=g) * 10.0 ** float(torch.randint(-6, 6, (1,), generator=g))
            for _ in range(4)]
    grid = torch.as_tensor(fmt.code_values()).to(torch.float64)
    grid = grid[torch.isfinite(grid)].unique()
    mids = ((grid[1:] + grid[:-1]) / 2)  # exact midpoints: ties, in float64
    tie = torch.cat([mids, grid]).to(torch.float32)
    tie = torch.cat([tie, torch.full((1,), fmt.max)])  # amax = max: scale exactly 1
    rows.append(tie[:K] if tie.numel() >= K else torch.cat([tie, torch.zeros(K - tie.numel())]))
    rows.append(-rows[-1])
    sub = torch.linspace(-4 * fmt.smallest_normal, 4 * fmt.smallest_normal, K)
    sub[0] = fmt.max  # scale 1, so the rest lands in the subnormal range
    rows.append(sub)
    rows.append(torch.zeros(K))
    z = torch.zeros(K)
    z[5] = -0.0
    z[7] = 3.0
    rows.append(z)
    x = torch.stack(rows)
    return x.to(dtype)


#: The quantizer's code paths: each runs where the CPU has its instructions, else skips saying so.
ISAS = {"scalar": (0, ""), "avx2": (1, "avx2 + fma + f16c"), "avx512": (2, "avx512f + avx512bw")}


def _isa(mod, name):
    level, flags = ISAS[name]
    if level > mod.cpu_isa():
        pytest.skip(f"this CPU ({cpu_model()}) lacks {flags}: the {name} path cannot run here")
    return level


def _schemes(fmt):
    """Every granularity, with segments that are and are not multiples of the vector widths, plus
    the scale options (no floor, a smaller qmax, power-of-two scales)."""
    f = FORMATS[fmt]
    base = [QuantScheme(format=fmt), QuantScheme(format=fmt, granularity="tensor"),
            QuantScheme(format=fmt, granularity="group", group_size=16),
            QuantScheme(format=fmt, granularity="group", group_size=7),
            QuantScheme(format=fmt, granularity="group", group_size=128),
            QuantScheme(format=fmt, granularity="block", block=(3, 5)),
            QuantScheme(format=fmt, granularity="block", block=(4, 64))]
    opts = [dict(amax_floor=0.0), dict(qmax=f.max / 2), dict(pow2_scale=True)]
    return base + [s.with_(**o) for s in base[:2] + base[5:6] for o in opts]


def _check_native_quant(x, scheme, isa):
    """Codes, bf16 and fp32 values and scales of every mode equal the spec's, signs of zeros too."""
    ref = quant.quantize(x, scheme)
    vals = ref.data.to(torch.float32)
    for mode in (0, 1, 2):
        out, s, amax = _common.native_quant(x, scheme, mode, isa)
        assert torch.equal(s, ref.scale), (mode, scheme.short_str())
        assert bool(torch.isfinite(amax).all())
        if mode == 0:
            assert torch.equal(out, ref.data.view(torch.uint8)), (mode, scheme.short_str())
        else:
            assert out.dtype == (torch.bfloat16 if mode == 1 else torch.float32)
            got = out.to(torch.float32)
            assert torch.equal(got, vals), (mode, scheme.short_str())
            assert torch.equal(torch.signbit(got), torch.signbit(vals)), ("sign of zero", mode, scheme.short_str())


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
def test_native_quant_equals_spec(mod, fmt, dtype, isa):
    """formats x input dtypes x code paths x schemes (every granularity and scale option), on rows
    of ties, subnormals, saturation, signed zeros, a zero row and huge dynamic ranges."""
    level = _isa(mod, isa)
    f = FORMATS[fmt]
    for seed, scheme in enumerate(_schemes(fmt)):
        x = _inputs(f, DTYPES[dtype], seed)
        if not bool(torch.isfinite(x).all()):
            x = torch.nan_to_num(x, posinf=0.0, neginf=0.0)  # fp16 cannot hold E5M2's max
        _check_native_quant(x, scheme, level)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_native_quant_every_bit_pattern(mod, dtype, isa):
    """All 65,536 bf16 / fp16 bit patterns (the finite ones) through every format and granularity."""
    level = _isa(mod, isa)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(DTYPES[dtype])
    x = x[torch.isfinite(x)]
    x = torch.cat([x, torch.zeros((-x.numel()) % 256, dtype=x.dtype)]).reshape(-1, 256)
    for fmt in FORMATS:
        for scheme in _schemes(fmt)[:7]:
            _check_native_quant(x, scheme, level)


def test_native_quant_random_many_shapes(mod):
    """Random rows with K from 1 to 300 (vector tails of every length) and group/block edges."""
    g = torch.Generator().manual_seed(0)
    for K in list(range(1, 40)) + [127, 128, 129, 300]:
        x = (torch.randn(7, K, generator=g) * torch.exp(torch.randn(7, 1, generator=g) * 6)).to(torch.bfloat16)
        for scheme in (QuantScheme(), QuantScheme(granularity="group", group_size=16),
                       QuantScheme(granularity="block", block=(2, 8)), QuantScheme(granularity="tensor")):
            ref = quant.quantize(x, scheme)
            q = _common.fast_quantize(x, scheme)
            assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), (K, scheme.short_str())
            assert torch.equal(q.scale, ref.scale), (K, scheme.short_str())


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_native_quant_flags_non_finite_blocks_and_fast_quantize_raises(mod, bad, isa):
    level = _isa(mod, isa)
    x = torch.randn(3, 40)
    x[1, 37] = bad  # in the scalar tail of the vector path
    scheme = QuantScheme()
    _, _, amax = _common.native_quant(x, scheme, 1, level)
    assert math.isinf(float(amax[1])) and bool(torch.isfinite(amax[[0, 2]]).all())
    x[1, 37] = 0.0
    x[2, 3] = bad  # in the vector body
    _, _, amax = _common.native_quant(x, scheme, 1, level)
    assert math.isinf(float(amax[2]))
    groups = QuantScheme(granularity="group", group_size=16)
    _, _, amax = _common.native_quant(x, groups, 0, level)
    assert math.isinf(float(amax[2, 0])) and int(torch.isfinite(amax).sum()) == amax.numel() - 1
    for s in (scheme, groups, QuantScheme(granularity="tensor"), QuantScheme(granularity="block", block=(2, 8))):
        with pytest.raises(ValueError, match="NaN|Inf|finite"):
            _common.fast_quantize(x, s)
    with pytest.raises(ValueError, match="NaN|Inf|finite"):
        fp8ref.get_backend("cpu-bf16").linear(x.to(torch.bfloat16), _weight(40, 8, "cpu-bf16"))


def test_native_quant_scale_overflow_raises_like_the_spec(mod):
    """amax / qmax beyond fp32 (a tiny qmax): the spec raises, so must the fast path."""
    scheme = QuantScheme(qmax=float.fromhex("0x1p-9"), granularity="group", group_size=4)
    x = torch.ones(2, 8)
    x[1, 5] = 1e37
    with pytest.raises(ValueError, match="overflows") as want:
        quant.quantize(x, scheme)
    with pytest.raises(ValueError, match="overflows") as got:
        _common.fast_quantize(x, scheme)
    assert str(got.value) == str(want.value)


def _weight(K, N, backend):
    be = fp8ref.get_backend(backend)
    return be.prepare_weight(quant.quantize(torch.randn(N, K), fp8ref.W8A8_FP8.weight))


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("out_bf16", [True, False], ids=["out-bf16", "out-fp32"])
@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32], ids=["y-bf16", "y-fp32"])
def test_scale_epilogue_equals_eager(mod, y_dtype, out_bf16, isa):
    level = _isa(mod, isa)
    g = torch.Generator().manual_seed(1)
    y = (torch.randn(37, 53, generator=g) * 100).to(y_dtype)
    y[0, :4] = torch.tensor([0.0, -0.0, 3e38, -3e38])  # zeros and overflow to +-inf after scaling
    sa = torch.rand(37, 1, generator=g) * 4
    sb = torch.rand(1, 53, generator=g) * 2
    bias = torch.randn(53, generator=g)
    out_dtype = torch.bfloat16 if out_bf16 else torch.float32
    for b in (None, bias):
        got = mod.scale_epilogue(y.clone(), sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous(),
                                 sa.reshape(-1) if b is None else b, b is not None, out_bf16, level)
        want = cpu._epilogue(y.clone(), sa, sb, b, out_dtype)
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.int16 if out_bf16 else torch.int32),
                           want.view(torch.int16 if out_bf16 else torch.int32))
    assert torch.equal(cpu._native_epilogue(y.clone(), sa, sb, bias, out_dtype).view(torch.uint8),
                       cpu._epilogue(y.clone(), sa, sb, bias, out_dtype).view(torch.uint8))


def test_scale_epilogue_rounds_nan_like_torch(mod):
    y = torch.tensor([[math.nan, 1.0]], dtype=torch.float32)
    got = mod.scale_epilogue(y, torch.ones(1), torch.ones(2), torch.ones(1), False, True, -1)
    assert math.isnan(float(got[0, 0])) and float(got[0, 1]) == 1.0


@pytest.mark.parametrize("name", ["cpu-bf16", "cpu-fp32"])
def test_cpu_linear_native_equals_eager(mod, monkeypatch, name):
    """The extension's quantizer and epilogue change no bit of ``cpu-bf16`` / ``cpu-fp32``."""
    be = fp8ref.get_backend(name)
    g = torch.Generator().manual_seed(2)
    for M, K, N, bias in [(1, 64, 32, False), (17, 203, 40, True), (64, 128, 96, False)]:
        x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
        w = be.prepare_weight(quant.quantize(torch.randn(N, K, generator=g), fp8ref.W8A8_FP8.weight))
        b = torch.randn(N, generator=g).to(torch.bfloat16) if bias else None
        y_native = be.linear(x, w, b)
        monkeypatch.setenv("FP8REF_NATIVE", "0")
        native.reset()
        try:
            eager = be.linear(x, w, b)
            two = be.scaled_mm(be.quantize(x, fp8ref.W8A8_FP8.activation), w, b)
        finally:
            monkeypatch.delenv("FP8REF_NATIVE")
            native.reset()
        assert torch.equal(y_native.view(torch.int16), eager.view(torch.int16))
        assert torch.equal(y_native.view(torch.int16), two.view(torch.int16))


def test_native_off_switch(monkeypatch):
    monkeypatch.setenv("FP8REF_NATIVE", "0")
    native.reset()
    try:
        assert native.get() is None
        assert _common.native_rows(torch.randn(2, 8), QuantScheme(), 0) is None
    finally:
        monkeypatch.delenv("FP8REF_NATIVE")
        native.reset()


def test_pack_weight_layout():
    """[N, K] -> [N/16, K/2, 16, 2]: byte (nb, p, j, t) is code (16 nb + j, 2 p + t), zero-padded;
    ``special`` flags the 32-byte groups holding a zero or subnormal magnitude."""
    N, K = 37, 33
    codes = torch.randint(8, 0x7F, (N, K), dtype=torch.uint8)  # no zero, no subnormal
    codes[5, 7] = 0x83  # a negative subnormal: group (0, 3)
    pb, special = cpu_fp8.pack_weight(codes)
    assert tuple(pb.shape) == (3, 17, 16, 2) and tuple(special.shape) == (3, 17)
    for n, k in [(0, 0), (5, 7), (36, 32), (17, 31), (16, 1)]:
        assert int(pb[n // 16, k // 2, n % 16, k % 2]) == int(codes[n, k])
    assert int(pb[2, 16, 4, 1]) == 0 and int(pb[2, 0, 15, 0]) == 0  # K and N padding
    want = torch.zeros(3, 17, dtype=torch.uint8)
    want[0, 3] = 1
    want[:, 16] = 1  # the K padding column (zeros)
    want[2, :] = 1  # rows 37..47 are zero padding
    assert torch.equal(special, want)


def test_packed_fast_decoding_equals_table_decoding(mod):
    """Groups flagged normal skip the table lookup: forcing the lookup everywhere changes no bit."""
    be = fp8ref.get_backend("cpu-fp8")
    if not be._packed():
        pytest.skip("no avx512_bf16 on this CPU: the packed path does not run")
    g = torch.Generator().manual_seed(4)
    N, K, M = 64, 256, 16
    codes = torch.randint(0, 0x7F, (N, K), generator=g, dtype=torch.uint8)
    codes |= torch.randint(0, 2, (N, K), generator=g, dtype=torch.uint8) << 7
    codes[:, :128] = torch.randint(8, 0x7F, (N, 128), generator=g, dtype=torch.uint8) | (codes[:, :128] & 0x80)
    # (the first half holds no zero or subnormal magnitude: fast groups; no NaN code 0x7F anywhere)
    pb, special = cpu_fp8.pack_weight(codes)
    assert 0 < int(special.sum()) < special.numel()
    a = torch.randint(0, 0x7F, (M, K), generator=g, dtype=torch.uint8)
    ones = torch.ones(M)
    y_fast = mod.fp8_e4m3_gemm_packed(a, pb, special, N, ones, torch.ones(N), ones, False)
    y_table = mod.fp8_e4m3_gemm_packed(a, pb, torch.ones_like(special), N, ones, torch.ones(N), ones, False)
    assert torch.equal(y_fast.view(torch.int32), y_table.view(torch.int32))
    ref = a.view(torch.float8_e4m3fn).to(torch.float64) @ codes.view(torch.float8_e4m3fn).to(torch.float64).T
    qa = quant.Quantized(a.view(torch.float8_e4m3fn), torch.ones(1, 1), QuantScheme(granularity="tensor"))
    qb = quant.Quantized(codes.view(torch.float8_e4m3fn), torch.ones(1, 1), QuantScheme(granularity="tensor"))
    bound = bounds.gemm_error_bound(qa, qb, None, out_dtype=torch.float32, accumulation=be.accumulation,
                                    output_roundings=1, y_ref=ref)
    assert bool(((y_fast.to(torch.float64) - ref).abs() <= bound).all())


def test_has_nan_e4m3_finds_each_nan_code_anywhere(mod):
    """Both NaN codes at every position of a 64-code vector block and of the scalar tail (n = 150),
    and none of the other 254 codes, against the torch check it replaced."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    base = finite.repeat(2)[:150].contiguous()
    assert not mod.has_nan_e4m3(base) and not cpu_fp8._nan_codes(base.view(torch.float8_e4m3fn))
    for nan in (0x7F, 0xFF):
        for i in range(150):
            c = base.clone()
            c[i] = nan
            assert mod.has_nan_e4m3(c), (nan, i)
    assert not mod.has_nan_e4m3(torch.empty(0, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        mod.has_nan_e4m3(base.view(10, 15).t())


def test_packed_gemm_within_fp32_bound_at_every_row_count(mod):
    """Row counts 1..17 and 33 (blocks of 16, 8 and every remainder), odd N and K (padding), bias."""
    be = fp8ref.get_backend("cpu-fp8")
    if not be._packed():
        pytest.skip("no avx512_bf16 on this CPU: the packed path does not run")
    g = torch.Generator().manual_seed(3)
    N, K = 45, 77
    qw = quant.quantize(torch.randn(N, K, generator=g), fp8ref.W8A8_FP8.weight)
    w = be.prepare_weight(qw)
    bias = torch.randn(N, generator=g)
    for M in list(range(1, 18)) + [33]:
        qa = quant.quantize(torch.randn(M, K, generator=g) * 5, fp8ref.W8A8_FP8.activation)
        for b in (None, bias):
            y = be.scaled_mm(qa, w, b, out_dtype=torch.float32)
            ref = gemm.scaled_mm(qa, qw, b, out_dtype=torch.float64)
            bound = bounds.gemm_error_bound(qa, qw, b, out_dtype=torch.float32, accumulation=be.accumulation,
                                            output_roundings=be.output_roundings, y_ref=ref)
            assert bool(((y.to(torch.float64) - ref).abs() <= bound).all()), M
            y_unprepared = be.scaled_mm(qa, qw, b, out_dtype=torch.float32)  # packs on the fly
            assert torch.equal(y, y_unprepared)


def _codes_of(vals):
    return vals.to(torch.float8_e4m3fn).view(torch.uint8)


def test_packed_gemm_exact_at_the_range_ends(mod):
    """The packed kernel computes on scaled operands (gemm_packed.cpp: weights times 2^-120 and
    pairs times 2^64 in groups without zero/subnormal codes, pairs times 2^-56 in the others, the sum
    times 2^56 after). Operands at the ends of E4M3's range, in the four pairings of large (the top
    binade, multiples of 32) and subnormal (m * 2^-9) values, zeros mixed into the weight so that both
    kinds of group meet in one sum: every product and partial sum is exact in fp32 there, so the
    result must be the exact dot product, bit for bit, at every row count."""
    if not fp8ref.get_backend("cpu-fp8")._packed():
        pytest.skip("no avx512_bf16 on this CPU: the packed path does not run")
    from fp8ref.kernels.cpu_fp8 import pack_weight

    g = torch.Generator().manual_seed(11)
    big = torch.tensor([256.0, 288.0, 320.0, 352.0, 384.0, 416.0, 448.0])
    small = torch.arange(1, 8, dtype=torch.float32) * 2.0 ** -9

    def draw(shape, pool, zeros):
        v = pool[torch.randint(0, pool.numel(), shape, generator=g)]
        v = v * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
        if zeros:
            v = v * (torch.rand(shape, generator=g) > 0.2)
        return v

    K, N = 77, 45
    for pa, pw in [(big, big), (big, small), (small, big), (small, small)]:
        w = draw((N, K), pw, zeros=True)
        w[: N // 2, :] = draw((N // 2, K), pw, zeros=False)  # some column blocks free of zeros
        packed, special = pack_weight(_codes_of(w))
        if pw is big:  # both kinds of group; a subnormal weight makes every group of it special
            assert 0 < int(special.sum()) < special.numel()
        for M in list(range(1, 18)) + [33]:
            a = draw((M, K), pa, zeros=False)
            ones_m, ones_n = torch.ones(M), torch.ones(N)
            y = mod.fp8_e4m3_gemm_packed(_codes_of(a), packed, special, N, ones_m, ones_n, ones_m, False)
            exact = (a.double() @ w.double().T).float()
            assert torch.equal(exact.double(), a.double() @ w.double().T)  # representable: an exact test
            assert torch.equal(y, exact), (float(pa[0]), float(pw[0]), M)


class _TwoCalls(fp8ref.Backend):
    name = "test-two-calls"

    def quantize(self, x, scheme):
        return quant.quantize(x, scheme)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return gemm.scaled_mm(a, b, bias, out_dtype=out_dtype)


class _BadLinear(_TwoCalls):
    name = "test-bad-linear"

    def linear(self, x, w, bias=None, out_dtype=torch.bfloat16, scheme=None):
        y = super().linear(x, w, bias, out_dtype, scheme)
        return y * (1 + 2.0 ** -7)  # one bf16 ulp off: within no bound it could claim to be exact


def test_backend_linear_default_is_the_two_calls():
    be = _TwoCalls()
    x = torch.randn(3, 32)
    qw = quant.quantize(torch.randn(8, 32), fp8ref.W8A8_FP8.weight)
    y = be.linear(x, qw)
    assert torch.equal(y, gemm.scaled_mm(quant.quantize(x, fp8ref.W8A8_FP8.activation), qw))


def test_probe_and_contract_reject_a_linear_that_differs():
    from fp8ref.conformance import contracts, strategies
    from fp8ref.select import probe

    case = fp8ref.Case(4, 32, 64, fp8ref.W8A8_FP8)
    assert probe(_TwoCalls(), case).compliant
    res = probe(_BadLinear(), case)
    assert not res.compliant and "linear.matches_two_calls" in res.detail
    p = contracts._L_EX[0]
    assert contracts.check_linear_matches_two_calls(_TwoCalls(), p) == 0.0
    with pytest.raises(contracts.ContractViolation, match="linear differs"):
        contracts.check_linear_matches_two_calls(_BadLinear(), p)
    assert isinstance(p, strategies.LinearProblem)


def _raises_runtime(fn, *args):
    with pytest.raises(RuntimeError):
        fn(*args)


def test_entry_points_guard_their_operands(mod):
    """Every entry point checks what it reads through raw pointers: shapes, sizes, dtypes, the
    device (a tensor off the CPU would be dereferenced as host memory) and the parameters it
    divides by, and raises RuntimeError instead of crashing the interpreter."""
    u8, f32 = torch.uint8, torch.float32
    a, b = torch.zeros(3, 40, dtype=u8), torch.zeros(5, 40, dtype=u8)
    sa, sb, bias = torch.ones(3), torch.ones(5), torch.zeros(5)
    meta = torch.empty(3, 40, dtype=u8, device="meta")
    gemm_ = mod.fp8_e4m3_gemm
    _raises_runtime(gemm_, a, torch.zeros(5, 41, dtype=u8), sa, sb, bias, False, -1)  # K mismatch
    _raises_runtime(gemm_, a.view(-1), b, sa, sb, bias, False, -1)  # 1-D a
    _raises_runtime(gemm_, a, b, torch.ones(2), sb, bias, False, -1)  # sa of the wrong size
    _raises_runtime(gemm_, a, b, sa, sb, torch.zeros(4), True, -1)  # bias of the wrong size
    _raises_runtime(gemm_, meta, b, sa, sb, bias, False, -1)  # not on the CPU
    _raises_runtime(gemm_, a, b, sa.to(device="meta"), sb, bias, False, -1)
    _raises_runtime(gemm_, a, b, sa, sb, bias, False, 3)  # a code path no CPU has
    packed, special = cpu_fp8.pack_weight(b)
    amx = mod.fp8_e4m3_gemm_amx
    _raises_runtime(amx, a, packed, special, 6, sa, sb, bias, False, True)  # N does not fit the packing
    _raises_runtime(amx, a, packed, special, -1, sa, sb, bias, False, True)
    _raises_runtime(amx, a[:, :38], packed, special, 5, sa, sb, bias, False, True)  # K does not fit
    _raises_runtime(amx, a, packed, special[:, :-1], 5, sa, sb, bias, False, True)
    _raises_runtime(amx, meta, packed, special, 5, sa, sb, bias, False, True)
    assert amx(a, packed, special, 5, sa, sb, bias, False, True).shape == (3, 5)
    x = torch.randn(4, 64)
    args = (448.0, 0.0, *_common.native_format_args(QuantScheme()), False, 0, -1)
    _raises_runtime(mod.quant_blocks, x.to(device="meta"), 1, 64, *args)
    _raises_runtime(mod.quant_blocks, x, 0, 64, *args)
    _raises_runtime(mod.quant_blocks, x, 1, 64, 0.0, *args[1:])  # qmax 0 would divide by zero
    _raises_runtime(mod.quant_blocks, x, 1, 64, math.nan, *args[1:])
    big = 2**62  # blocks larger than the tensor are the tensor: no overflow in r * c
    assert mod.quant_blocks(x, big, big, *args)[1].shape == (1, 1)
    _raises_runtime(mod.scale_epilogue, torch.zeros(3, 5, device="meta"), sa, sb, bias, False, True, -1)
    _raises_runtime(mod.scale_epilogue, torch.zeros(3, 5), sa, torch.ones(4), bias, False, True, -1)
    assert gemm_(a, b, sa, sb, bias, True).shape == (3, 5)  # isa defaults to this CPU's best path
    for M, N in ((0, 5), (3, 0), (0, 0)):  # empty outputs, no division by zero
        out = mod.scale_epilogue(torch.zeros(M, N, dtype=f32), torch.ones(M), torch.ones(N), bias[:N], False, True,
                                 -1)
        assert out.shape == (M, N)
    _raises_runtime(mod.amx_emu_tdpbf16ps, torch.zeros(17, 16), torch.zeros(17, 32, dtype=torch.bfloat16),
                    torch.zeros(16, 32, dtype=torch.bfloat16))  # 17 rows: the tile would fault
    _raises_runtime(mod.amx_emu_tdpbf16ps, torch.zeros(2, 2), torch.zeros(2, 4, dtype=torch.bfloat16).view(-1),
                    torch.zeros(2, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
def test_native_quant_every_midpoint(mod, fmt, isa):
    """The rounding step alone, on every FP8 rounding boundary: fp32 rows whose amax is qmax (so the
    scale is exactly 1 and x / s = x) holding each midpoint between neighbouring FP8 values
    (subnormal ones and binade edges included), the grid values themselves, and their fp32
    neighbours 1, 2 and 64 ulps either side, both signs. The vector bodies round by adding a power
    of two (quant.cpp, MagicRound); a tie broken the wrong way or a carry lost shows here."""
    level = _isa(mod, isa)
    f = FORMATS[fmt]
    grid = torch.arange(256, dtype=torch.uint8).view(f.torch_dtype).to(torch.float32)
    grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0)])
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32: FP8 values have few significant bits
    base = torch.cat([grid, mids])
    bits = base.view(torch.int32)
    near = [base] + [(bits + d).clamp(min=0).view(torch.float32) for d in (-64, -2, -1, 1, 2, 64)]
    vals = torch.cat(near)
    vals = vals[vals <= f.max]
    vals = torch.cat([vals, -vals])
    cols = 256
    pad = (-vals.numel()) % (cols - 1)
    vals = torch.cat([vals, torch.zeros(pad)]).reshape(-1, cols - 1)
    x = torch.cat([torch.full((vals.shape[0], 1), f.max), vals], dim=1)  # amax = qmax in every row
    scheme = QuantScheme(format=fmt)
    assert bool((quant.quantize(x, scheme).scale == 1).all())
    _check_native_quant(x.contiguous(), scheme, level)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
def test_native_quant_near_midpoints_after_division(mod, fmt, isa):
    """The division by the scale, where it matters: the vector bodies multiply by 1/s and go back to
    x / s near a rounding midpoint (quant.cpp, Recip). Rows whose scale s is not a power of two hold,
    for every FP8 midpoint and grid value m, the fp32 x nearest m * s and its neighbours up to 12
    ulps either side, so x / s falls within a few ulps of m on both sides (ties included where m * s
    is exact); a lane whose multiplied value rounds differently from the spec's quotient shows here."""
    level = _isa(mod, isa)
    f = FORMATS[fmt]
    grid = torch.arange(256, dtype=torch.uint8).view(f.torch_dtype).to(torch.float32)
    grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0)])
    m = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    rows = []
    for target in (0.37, 1 / 3, 3.1, 1.7e-3, 12345.6, 2.0 ** -100 * 1.3):
        amax = torch.tensor(f.max * target, dtype=torch.float32)
        s = amax / f.max  # the spec's scale for a row with this amax
        centre = (m * s).view(torch.int32)
        vals = torch.cat([(centre + d).view(torch.float32) for d in range(-12, 13)])
        vals = vals[(vals > 0) & (vals <= amax)]
        vals = torch.cat([vals, -vals])
        pad = (-vals.numel()) % 255
        vals = torch.cat([vals, torch.zeros(pad)]).reshape(-1, 255)
        rows.append(torch.cat([torch.full((vals.shape[0], 1), float(amax)), vals], dim=1))
    x = torch.cat(rows).contiguous()
    for scheme in (QuantScheme(format=fmt), QuantScheme(format=fmt, granularity="group", group_size=64)):
        _check_native_quant(x, scheme, level)


def _finite_bf16(limit: float) -> torch.Tensor:
    """Every finite bf16 value with |x| <= limit (both signs, both zeros, subnormals)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[torch.isfinite(x) & (x.float().abs() <= limit)]


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
def test_native_quant_bf16_every_midpoint(mod, fmt, isa):
    """bf16 input has its own AVX2 body (quant.cpp, quant_bf16_avx2: codes from a scaled magic
    addition, the clamp skipped for an on-grid qmax). Every FP8 value and midpoint has few enough
    significant bits to be a bf16, so rows whose amax is qmax * 2^k (a scale of exactly 2^k: x / s
    is exact) holding every bf16 value up to that amax put each tie, each grid value and each of
    their bf16 neighbours through the rounding, at three scales, per row and per group."""
    level = _isa(mod, isa)
    f = FORMATS[fmt]
    for k in (0, -3, 5):
        amax = f.max * 2.0 ** k
        vals = _finite_bf16(amax)
        pad = (-vals.numel()) % (31 * 8)
        vals = torch.cat([vals, torch.zeros(pad, dtype=torch.bfloat16)]).reshape(-1, 31)
        # each 32-element group starts with amax; rows of 8 groups
        x = torch.cat([torch.full((vals.shape[0], 1), amax, dtype=torch.bfloat16), vals], dim=1).reshape(-1, 256)
        x = x.contiguous()
        for scheme in (QuantScheme(format=fmt), QuantScheme(format=fmt, granularity="group", group_size=32)):
            assert bool((quant.quantize(x, scheme).scale == 2.0 ** k).all())
            _check_native_quant(x, scheme, level)


def test_native_quant_bf16_off_grid_qmax_clamps(mod):
    """quant_blocks takes any qmax, and one that is not an FP8 value keeps the clamp in the bf16 AVX2
    body (quant_bf16_avx2<.., CLAMP>; QuantScheme admits only grid values, so this calls the
    extension directly and compares with its scalar path, whose explicit clamp the spec tests
    cover). qmax is one fp32 ulp below E4M3FN's midpoint 304 (between 288 and 320); the rows' amax
    values are chosen so that amax / s lands above qmax (asserted), where the value unclamped
    would round to 320 and the clamped one rounds to 288."""
    _isa(mod, "avx2")
    qmax = float(torch.tensor(304.0).view(torch.int32).sub(1).view(torch.float32))
    amax = _finite_bf16(1e4)
    amax = amax[amax.float() > 1]
    s = (amax.float() / torch.tensor(qmax)).float()
    over = amax[(amax.float() / s) >= 304.0][:64]
    assert over.numel() > 0, "no bf16 amax makes amax / s reach the midpoint: the test would not test the clamp"
    x = (over.reshape(-1, 1) * torch.tensor([1.0, -1.0, 0.5, 0.25], dtype=torch.bfloat16)).to(torch.bfloat16)
    x = torch.cat([x, x.flip(1)] * 8, dim=1).contiguous()  # 64 columns: the vector body, not only the tail
    args = (qmax, 0.0, 3, -6, 7, True, False, 0)
    for r, c in ((1, 64), (1, 32)):
        vec, scalar = mod.quant_blocks(x, r, c, *args, 1), mod.quant_blocks(x, r, c, *args, 0)
        assert torch.equal(vec[1], scalar[1])
        assert torch.equal(vec[0], scalar[0]), (r, c)
    assert bool((vec[0][:, 0] == 0x79).all())  # 288 (clamped); unclamped, the tie at 304 would give 320, 0x7A


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_native_quant_ignores_flush_to_zero(mod, isa, dtype):
    """The quantizer computes IEEE results whatever MXCSR the calling thread has: under
    torch.set_flush_denormal(True) (FTZ and DAZ), rows of subnormal inputs (scale FLT_MIN with no
    floor: a DAZ'd amax would give another scale) and rows whose values round to FP8 subnormals (the
    bf16 body produces fp32 subnormals on the way: quant_bf16_avx2) must give the spec's bits,
    computed beforehand without flushing. One thread, so the calling thread runs the loops."""
    level = _isa(mod, isa)
    dt = DTYPES[dtype]
    tiny = torch.arange(1, 65, dtype=torch.float32) * 2.0 ** -133  # bf16 subnormals
    small = torch.linspace(-4 * E4M3FN.smallest_normal, 4 * E4M3FN.smallest_normal, 63)
    rows = [torch.cat([tiny, -tiny]), torch.cat([torch.tensor([E4M3FN.max]), small, -small, torch.zeros(1)])]
    x = torch.stack([r[:128] for r in rows]).to(dt).contiguous()
    scheme = QuantScheme(amax_floor=0.0)
    schemes = (scheme, scheme.with_(granularity="group", group_size=32))
    refs = [quant.quantize(x, sc) for sc in schemes]
    assert bool((refs[0].data.view(torch.uint8)[0] != 0).any()), "the subnormal row must have non-zero codes"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if not torch.set_flush_denormal(True):
        torch.set_num_threads(threads)
        pytest.skip("this CPU cannot flush denormals (torch.set_flush_denormal returned False)")
    try:
        outs = [_common.native_quant(x, sc, 0, level) for sc in schemes]
        assert float(torch.tensor(2.0 ** -140) * 1) == 0.0  # flushing is on: the check means something
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    for ref, (out, sc, _) in zip(refs, outs, strict=True):
        assert torch.equal(sc, ref.scale)
        assert torch.equal(out, ref.data.view(torch.uint8))


def _many_groups(dtype, g):
    """[5, 16 * 27] rows whose 16-element groups have amaxes of every kind the scale rule meets:
    exact powers of two times qmax (a pow2 scale stays), zeros (s = 0 -> 1), values just above and
    below powers of two, tiny ones (a subnormal scale becomes FLT_MIN; fp32/bf16 only) and large ones.
    27 groups: three batches of eight for the vector code plus a tail."""
    x = torch.randn(5, 27, 16, generator=g)
    lo, hi = (-14, 8) if dtype == torch.float16 else (-20, 20)  # fp16 holds 2^-14 .. 65504 as normals
    mags = [2.0 ** float(e) for e in torch.randint(lo, hi, (5, 27), generator=g).flatten()]
    x = x / x.abs().amax(dim=2, keepdim=True) * torch.tensor(mags).reshape(5, 27, 1)
    x[0, 3] = 0.0
    x[1, :8, 0] = E4M3FN.max * 2.0 ** 5  # amax exactly qmax 2^5: s = 2^5, a power of two
    x[1, 8:16, 0] = E4M3FN.max * 2.0 ** 5 * (1 + 2.0 ** -7)  # just above: pow2 rounds up to 2^6
    if dtype != torch.float16:
        x[2, 5:20] *= 2.0 ** -125  # amaxes near 2^-125: s = amax / 448 is an fp32 subnormal
    return x.reshape(5, 27 * 16).to(dtype)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_native_quant_scales_of_many_groups(mod, dtype, isa):
    """The scales (and codes) of rows of 27 groups, batches of eight as the vector code takes them:
    each scale rule (floor or none, power-of-two or not) on group and block scales, equal to the spec."""
    level = _isa(mod, isa)
    x = _many_groups(DTYPES[dtype], torch.Generator().manual_seed(5))
    for base in (QuantScheme(granularity="group", group_size=16), QuantScheme(granularity="block", block=(2, 16))):
        for opts in ({}, dict(amax_floor=0.0), dict(pow2_scale=True), dict(pow2_scale=True, amax_floor=0.0)):
            scheme = base.with_(**opts)
            ref = quant.quantize(x, scheme)
            out, s, amax = _common.native_quant(x, scheme, 0, level)
            assert torch.equal(s, ref.scale), (scheme.short_str(), opts)
            assert torch.equal(out, ref.data.view(torch.uint8)), (scheme.short_str(), opts)
            assert bool(torch.isfinite(amax).all())
    if dtype != "fp16":  # the subnormal scales are there, so the check above covered them
        no_floor = QuantScheme(granularity="group", group_size=16, amax_floor=0.0)
        assert float(quant.quantize(x, no_floor).scale[2, 6]) == torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_native_quant_drops_exactly_the_bad_groups(mod, dtype, isa):
    """NaN, +Inf and -Inf in some of 27 groups (inside batches of eight and in the tail), and scales
    that overflow fp32 (by the division, and by the power-of-two rounding alone): exactly those
    blocks get amax +inf; every other block keeps the spec's scale; fast_quantize raises as the spec."""
    level = _isa(mod, isa)
    dt = DTYPES[dtype]
    x = torch.randn(4, 27 * 16, generator=torch.Generator().manual_seed(6)).to(dt)
    bad = {(0, 2): math.nan, (0, 9): math.inf, (1, 7): -math.inf, (2, 26): math.nan, (3, 0): math.inf, (3, 8): math.nan}
    for (r, grp), v in bad.items():
        x[r, grp * 16 + 5] = v
    clean = x.clone()
    for (r, grp) in bad:
        clean[r, grp * 16 + 5] = 0.0
    scheme = QuantScheme(granularity="group", group_size=16)
    _, s, amax = _common.native_quant(x, scheme, 0, level)
    ref = quant.quantize(clean, scheme)
    dropped = torch.zeros(4, 27, dtype=torch.bool)
    for key in bad:
        dropped[key] = True
    assert torch.equal(torch.isinf(amax), dropped)
    assert torch.equal(s[~dropped], ref.scale[~dropped]) and bool((s[dropped] == 1).all())
    with pytest.raises(ValueError, match="NaN|Inf|finite"):
        _common.fast_quantize(x, scheme)
    if dtype == "fp16":
        return  # fp16 cannot hold the amaxes below
    # qmax 2^-9: amax 2^120 overflows s; amax 1.5 2^117 gives s = 1.5 2^126, finite, whose power of two is 2^127
    # (kept), and 1.5 2^118 gives 1.5 2^127, whose power of two 2^128 overflows (pow2 only)
    tiny_q = QuantScheme(qmax=2.0 ** -9, granularity="group", group_size=16)
    y = torch.ones(2, 27 * 16)
    y[0, 4 * 16] = 2.0 ** 120
    y[1, 3 * 16 + 1] = 1.5 * 2.0 ** 117
    y[1, 12 * 16 + 2] = 1.5 * 2.0 ** 118
    y = y.to(dt)
    for pow2, want in ((False, {(0, 4)}), (True, {(0, 4), (1, 12)})):
        sc = tiny_q.with_(pow2_scale=pow2)
        _, s, amax = _common.native_quant(y, sc, 0, level)
        assert {tuple(i) for i in torch.isinf(amax).nonzero().tolist()} == want, pow2
        keep = torch.isfinite(amax)
        with pytest.raises(ValueError, match="overflows") as spec_err:
            quant.quantize(y, sc)
        with pytest.raises(ValueError, match="overflows") as fast_err:
            _common.fast_quantize(y, sc)
        assert str(fast_err.value) == str(spec_err.value)
        y2 = y.clone()
        for r, grp in want:
            y2[r, grp * 16: grp * 16 + 16] = 1.0
        assert torch.equal(s[keep], quant.quantize(y2, sc).scale[keep]), pow2
