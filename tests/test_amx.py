"""cpu-fp8-amx: the emulated tiles against the documented instruction, the kernel's tile logic on
them against the spec (every machine), and the real tiles where the CPU has AMX.

The real-tile tests skip with the reason (the missing flags, or the OS's refusal) elsewhere; the
emulated ones run everywhere the extension is built, and exercise every configuration, tail and
chunk that the real kernel uses, with the fault checks of the hardware (tests/test_amx.py is the
only place that asserts what the emulation computes; fp8ref/kernels/csrc/amx_tiles.h says why).
"""

import struct

import pytest
import torch

import fp8ref
from fp8ref._machine import cpu_model
from fp8ref.kernels import cpu_fp8_amx, native
from fp8ref.registry import Case
from fp8ref.spec import bounds, gemm, quant
from fp8ref.spec.schemes import FP8_PER_TENSOR, W8A8_FP8, QuantScheme, Recipe


@pytest.fixture(scope="module")
def mod():
    native.reset()
    m = native.get()
    if m is None:
        pytest.skip(fp8ref.get_backend("cpu-fp8").available() or "FP8REF_NATIVE=0")
    return m


@pytest.fixture(scope="module")
def emulated(mod):
    be = cpu_fp8_amx.CpuFp8AmxBackend()
    be.emulate = True
    return be


@pytest.fixture(scope="module")
def real(mod):
    be = fp8ref.get_backend("cpu-fp8-amx")
    reason = be.available()
    if reason:
        pytest.skip(f"no real AMX tiles here: {reason}")
    return be


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _sdm_model(c, a, b):
    """TDPBF16PS as the Intel SDM writes it, in Python floats rounded to fp32 after each step:
    per output, even and odd temporaries from 0 (one fp32 FMA each per pair, exact products
    here), then C + (even + odd)."""
    m_rows, n_cols, k_pairs = c.shape[0], c.shape[1], a.shape[1] // 2
    out = c.clone()
    for m in range(m_rows):
        for n in range(n_cols):
            t = [0.0, 0.0]
            for k in range(k_pairs):
                for h in range(2):
                    t[h] = _f32(t[h] + float(a[m, 2 * k + h]) * float(b[k, 2 * n + h]))
            out[m, n] = _f32(float(c[m, n]) + _f32(t[0] + t[1]))
    return out


# ---------------------------------------------------------------- the emulated instruction

def test_emulated_tdpbf16ps_follows_the_sdm_pseudocode(mod):
    g = torch.Generator().manual_seed(0)
    for m_rows, n_cols, k_pairs in [(1, 1, 1), (3, 5, 7), (16, 16, 16)]:
        c = torch.randn(m_rows, n_cols, generator=g)
        a = torch.randn(m_rows, 2 * k_pairs, generator=g).to(torch.bfloat16)
        b = torch.randn(k_pairs, 2 * n_cols, generator=g).to(torch.bfloat16)
        got = mod.amx_emu_tdpbf16ps(c, a, b)
        assert torch.equal(got.view(torch.int32), _sdm_model(c, a.float(), b.float()).view(torch.int32))


def test_emulated_tdpbf16ps_adds_even_and_odd_sums_before_c(mod):
    """C = 0, products even (1, 0), odd (2^-24, 2^-24): the SDM's order gives 1 + 2^-23; adding
    the four products one by one into C would give 1 (1 + 2^-24 ties to 1)."""
    a = torch.tensor([[1.0, 2.0**-12, 0.0, 2.0**-12]]).to(torch.bfloat16)
    b = torch.tensor([[1.0, 2.0**-12], [0.0, 2.0**-12]]).to(torch.bfloat16)
    got = mod.amx_emu_tdpbf16ps(torch.zeros(1, 1), a, b)
    assert float(got) == 1.0 + 2.0**-23


def test_emulated_tdpbf16ps_flushes_denormals(mod):
    """FTZ: a product of +-2^-140 (an fp32 denormal) alone gives zero; DAZ: a denormal bf16 input
    reads as zero (2^-133 x 2^100 would be 2^-33); 2^-126 (the smallest normal) stays."""
    tiny = torch.tensor([[2.0**-70, 0.0]]).to(torch.bfloat16)
    got = mod.amx_emu_tdpbf16ps(torch.zeros(1, 2), tiny, torch.tensor([[2.0**-70, 0.0, -(2.0**-70), 0.0]])
                                .to(torch.bfloat16))
    assert got.tolist() == [[0.0, 0.0]]
    denormal = torch.tensor([1, 0], dtype=torch.int16).view(torch.bfloat16).reshape(1, 2)  # 2^-133, 0
    got = mod.amx_emu_tdpbf16ps(torch.zeros(1, 1), denormal, torch.tensor([[2.0**100, 0.0]]).to(torch.bfloat16))
    assert float(got) == 0.0
    assert float(mod.amx_emu_tdpbf16ps(torch.zeros(1, 1), torch.tensor([[2.0**-66, 0.0]]).to(torch.bfloat16),
                                       torch.tensor([[2.0**-60, 0.0]]).to(torch.bfloat16))) == 2.0**-126


@pytest.mark.parametrize("c,a,b,needle", [
    ((17, 4), (17, 8), (4, 8), "at most 16 x 64"),  # 17 rows
    ((2, 17), (2, 8), (4, 34), "at most 16 x 64"),  # 68 bytes per row
    ((2, 4), (2, 8), (3, 8), "would fault"),  # A has 4 pairs, B 3 rows
    ((2, 4), (3, 8), (4, 8), "would fault"),  # C and A rows differ
    ((2, 3), (2, 8), (4, 8), "would fault"),  # C and B widths differ
])
def test_emulated_tiles_fault_where_the_hardware_would(mod, c, a, b, needle):
    with pytest.raises(RuntimeError, match=needle):
        mod.amx_emu_tdpbf16ps(torch.zeros(*c), torch.zeros(*a).to(torch.bfloat16), torch.zeros(*b).to(torch.bfloat16))


# ---------------------------------------------------------------- the kernel on emulated tiles

def test_emulated_kernel_passes_the_self_test(emulated):
    """Exact answers on integer- and subnormal-valued operands over every tail and chunk, the fp32
    bound on random ones, round-to-nearest-even: what the real tiles must pass to be used."""
    res = cpu_fp8_amx.self_test(emulate=True)
    assert res["reason"] is None, res["reason"]
    assert res["checks"] == 3 * len(cpu_fp8_amx.SELF_TEST_SHAPES) + 6


@pytest.mark.parametrize("recipe", [W8A8_FP8, FP8_PER_TENSOR, Recipe("mixed", QuantScheme(granularity="tensor"),
                                                                      QuantScheme(granularity="row"))],
                         ids=["row", "tensor", "mixed"])
def test_emulated_kernel_within_fp32_bound(emulated, monkeypatch, recipe):
    """Row counts across tile and chunk edges, odd N and K, bias, every output dtype; more rows
    than AMX_ROWS go in chunks and give the bits of one call."""
    g = torch.Generator().manual_seed(1)
    shapes = [(1, 45, 77), (16, 16, 32), (17, 33, 530), (40, 20, 17), (9, 20, 2100), (35, 17, 2090),
              (300, 17, 40)]  # K chunks of 2048 with C in the tiles and in memory; a 256-row panel edge
    for M, N, K in shapes:
        qw = quant.quantize(torch.randn(N, K, generator=g), recipe.weight)
        w = emulated.prepare_weight(qw)
        qa = quant.quantize(torch.randn(M, K, generator=g) * 4, recipe.activation)
        bias = torch.randn(N, generator=g)
        ref = gemm.scaled_mm(qa, qw, bias, out_dtype=torch.float64)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = emulated.scaled_mm(qa, w, bias, out_dtype=out_dtype)
            bound = bounds.gemm_error_bound(qa, qw, bias, out_dtype=out_dtype, accumulation=emulated.accumulation,
                                            output_roundings=emulated.output_roundings, y_ref=ref)
            err = (y.to(torch.float64) - ref).abs()
            assert y.dtype == out_dtype and bool((err <= bound).all()), (M, N, K, out_dtype)
        whole = emulated.scaled_mm(qa, w, bias, out_dtype=torch.float32)
        monkeypatch.setattr(cpu_fp8_amx, "AMX_ROWS", 16)
        chunked = emulated.scaled_mm(qa, qw, bias, out_dtype=torch.float32)  # unprepared: packs on the fly
        monkeypatch.undo()
        assert torch.equal(whole.view(torch.int32), chunked.view(torch.int32))


@pytest.mark.parametrize("M, N, K", [(5, 45, 77), (17, 33, 530), (40, 20, 2100), (300, 50, 64)])
def test_kernel_rounds_to_bf16_as_torch_does(mod, emulated, M, N, K):
    """With bf16 out the kernel's epilogue rounds itself: the bits of its fp32 result's
    ``.to(torch.bfloat16)``, with C in the tiles (M <= 32) and in memory, over panel edges; on
    integer-valued operands (most outputs are exact bf16 ties: odd integers in [257, 511], ...) and
    on random scaled ones."""
    g = torch.Generator().manual_seed(5)
    ia, iw = cpu_fp8_amx._exact_operands("integers", M, N, K, g)
    ra = quant.quantize(torch.randn(M, K, generator=g) * 8, W8A8_FP8.activation)
    rw = quant.quantize(torch.randn(N, K, generator=g) * 1e-3, W8A8_FP8.weight)
    tiles = [True] + ([False] if mod.amx_status() == "" else [])  # emulated, and real where they run
    ties = 0
    for qa, qw, bias in ((ia, iw, torch.randint(-8, 9, (N,), generator=g).float()),
                         (ra, rw, torch.randn(N, generator=g))):
        packed = cpu_fp8_amx.pack_weight(qw.data.view(torch.uint8))
        sa = qa.scale.reshape(-1).expand(M).contiguous()
        sb = qw.scale.reshape(-1).expand(N).contiguous()
        for has_bias, emulate in [(h, e) for h in (False, True) for e in tiles]:
            args = (qa.data.view(torch.uint8), *packed, N, sa, sb, bias, has_bias, emulate)
            y32, y16 = mod.fp8_e4m3_gemm_amx(*args), mod.fp8_e4m3_gemm_amx(*args, out_bf16=True)
            assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
            assert torch.equal(y16.view(torch.int16), y32.to(torch.bfloat16).view(torch.int16))
            ties += int(((y32.view(torch.int32) & 0xFFFF) == 0x8000).sum())
    assert ties > 0  # the rounding of ties was exercised


def test_emulated_kernel_decodes_every_code_exactly(emulated):
    """An identity on one side gives the other side's 254 finite codes back, through both the
    weight decoding (table or AVX-512 rebias) and the activation table."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    codes = torch.cat([codes, torch.zeros(2, dtype=torch.uint8)]).reshape(4, 64).view(torch.float8_e4m3fn)
    tensor, one = QuantScheme(granularity="tensor"), torch.ones(1, 1)
    vals = quant.Quantized(codes, one, tensor)
    ident = quant.Quantized(torch.eye(64).to(torch.float8_e4m3fn), one, tensor)
    assert torch.equal(emulated.scaled_mm(ident, vals, out_dtype=torch.float32), codes.float().t())
    assert torch.equal(emulated.scaled_mm(vals, ident, out_dtype=torch.float32), codes.float())


def test_emulated_kernel_conforms(emulated):
    """The whole conformance table (ci profile) on the emulated tiles."""
    from fp8ref.conformance import check

    report = check(emulated, "ci")
    assert report.available and sum(r.examples or 0 for r in report.results) > 0, report.reason
    assert report.passed, [(r.contract, r.message) for r in report.failures]


# ---------------------------------------------------------------- availability and declines

def test_amx_backend_says_why_it_cannot_run(mod):
    be = fp8ref.get_backend("cpu-fp8-amx")
    status = mod.amx_status()
    if status:
        reason = be.available()
        assert reason is not None and "needs AMX tiles" in reason and status in reason
        missing = [f for f in cpu_fp8_amx.AMX_FLAGS if f not in fp8ref._machine.cpu_flags()]
        if status.startswith("this CPU lacks"):  # CPUID (the extension) and /proc/cpuinfo agree
            assert missing, f"the extension says {status!r}, /proc/cpuinfo lists every AMX flag"
        else:  # the CPU has AMX, the OS will not hand out its tile state
            assert "the OS" in status and not missing, (status, missing)
        with pytest.raises(RuntimeError, match="cannot run here"):
            qa = quant.quantize(torch.randn(2, 32))
            be.scaled_mm(qa, quant.quantize(torch.randn(16, 32)))
    else:
        assert be.available() is None or "self-test" in be.available()


def test_self_test_verdict_is_keyed_to_the_self_test_source(monkeypatch):
    """A cached verdict does not outlive a change to the self-test (its module's source)."""
    before = cpu_fp8_amx._cache_path()
    monkeypatch.setattr(cpu_fp8_amx, "_source_digest", lambda: "0" * 16)
    assert cpu_fp8_amx._cache_path() != before and cpu_fp8_amx._cache_path().parent == before.parent


@pytest.mark.parametrize("result, needle", [
    ({"reason": None, "matches_emulation": True, "checks": 33}, "self-test passed; the real tiles' bits equal"),
    ({"reason": None, "matches_emulation": False, "checks": 33}, "self-test passed; the real tiles' bits differ"),
    ({"reason": "the cpu-fp8-amx self-test failed 2 of 33 checks", "matches_emulation": False},
     "self-test failed: the cpu-fp8-amx self-test failed 2 of 33"),
    ({"reason": "the cpu-fp8-amx self-test did not finish in 600 s", "matches_emulation": None},
     "self-test failed: the cpu-fp8-amx self-test did not finish"),
])
def test_self_test_summary_says_whether_the_chip_computes_the_emulated_bits(monkeypatch, result, needle):
    """What the bench header and ``python -m fp8ref.kernels.build`` report on an AMX machine."""
    monkeypatch.setattr(cpu_fp8_amx, "_result", result)
    assert cpu_fp8_amx.self_test_summary().startswith(needle)


def test_the_chip_model_test_is_outside_the_default_run():
    """tox's default run deselects the ``hardware_model`` marker, and the marker is declared."""
    import configparser
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(root / "tox.ini")
    assert "not hardware_model" in tox["testenv:tests"]["commands"]
    assert "hardware_model:" in (root / "pyproject.toml").read_text()
    assert test_real_tiles_compute_the_emulated_bits.pytestmark[0].name == "hardware_model"


def test_amx_backend_declines_what_it_was_not_tested_for():
    be = fp8ref.get_backend("cpu-fp8-amx")
    assert "per-row or per-tensor" in be.supports(Case(4, 256, 256, fp8ref.FP8_BLOCK))
    assert "e4m3fn" in be.supports(Case(4, 32, 32, fp8ref.W8A8_FP8_ROCM))
    assert "CPU" in be.supports(Case(4, 32, 32, W8A8_FP8, device="cuda"))
    assert be.supports(Case(4096, 32, 32, W8A8_FP8)) is None


# ---------------------------------------------------------------- the real tiles (AMX CPUs only)

def test_real_tiles_pass_the_self_test(real):
    res = cpu_fp8_amx.self_test(emulate=False)
    assert res["reason"] is None, res["reason"]


@pytest.mark.hardware_model
def test_real_tiles_compute_the_emulated_bits(real, emulated):
    """Whether the emulation models the chip: same bits on random operands. Not in the default run
    (tox deselects ``hardware_model``): the emulation follows the SDM's pseudocode of TDPBF16PS
    (even and odd sums from 0, then C + (even + odd)), Intel's intrinsics guide writes the products
    added one by one into C, and no AMX machine has told which one the chip does. A difference is
    no defect (the self-test checks the bound, exact sums and rounding to nearest even, and decides
    whether the backend runs); this test turns the question into an answer on the first such
    machine: ``pytest tests/test_amx.py`` runs it."""
    res = cpu_fp8_amx.self_test(emulate=False)
    assert res["matches_emulation"], f"on {cpu_model()} the real tiles round differently from the emulation"


def test_real_tiles_within_fp32_bound_at_llama_shapes(real):
    g = torch.Generator().manual_seed(2)
    qw = quant.quantize(torch.randn(512, 4096, generator=g), W8A8_FP8.weight)
    w = real.prepare_weight(qw)
    for M in (1, 16, 64, 300):
        qa = quant.quantize(torch.randn(M, 4096, generator=g), W8A8_FP8.activation)
        y = real.scaled_mm(qa, w, out_dtype=torch.float32)
        ref = gemm.scaled_mm(qa, qw, out_dtype=torch.float64)
        bound = bounds.gemm_error_bound(qa, qw, None, out_dtype=torch.float32, accumulation=real.accumulation,
                                        output_roundings=1, y_ref=ref)
        assert bool(((y.to(torch.float64) - ref).abs() <= bound).all()), M
