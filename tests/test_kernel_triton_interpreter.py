"""The triton backend's rounding, and what Triton's CPU interpreter gets wrong (the ledger).

The interpreter bugs are reproduced as strict xfails from ``properties/known_failures.py``: an
upstream fix turns them into XPASS, which fails and forces the ledger entry out.
"""

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fp8ref.kernels.triton_kernels import interpreting, rne_e4m3_reference, triton_quantize  # noqa: E402
from fp8ref.spec import quant  # noqa: E402
from fp8ref.spec.formats import E4M3FN  # noqa: E402
from fp8ref.spec.schemes import QuantScheme  # noqa: E402


def _ledger():
    path = Path(__file__).resolve().parents[1] / "properties" / "known_failures.py"
    spec = importlib.util.spec_from_file_location("fp8ref_known_failures", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LEDGER = _ledger()
needs_interpreter = pytest.mark.skipif(not interpreting(), reason="these reproduce bugs of TRITON_INTERPRET=1")


def _e4m3_boundary_values() -> torch.Tensor:
    """Every E4M3FN value, every midpoint between neighbours, and the fp32 values one ulp either side."""
    vals = E4M3FN.finite_values().to(torch.float32)
    vals = vals[vals >= 0]
    mids = (vals[:-1] + vals[1:]) / 2  # exact in fp32
    pts = torch.cat([vals, mids])
    up = torch.nextafter(pts, torch.full_like(pts, float("inf")))
    down = torch.nextafter(pts, torch.zeros_like(pts))
    allv = torch.cat([pts, up, down, torch.tensor([2.0**-130, 1e-30])])
    allv = allv[allv <= E4M3FN.max]
    return torch.cat([allv, -allv])


def test_integer_rounding_matches_torch_cast_on_every_boundary():
    v = _e4m3_boundary_values()
    assert torch.equal(rne_e4m3_reference(v), v.to(torch.float8_e4m3fn).view(torch.uint8))


def test_integer_rounding_matches_torch_cast_on_random_fp32():
    g = torch.Generator().manual_seed(0)
    v = (torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-20, 9, (200_000,), generator=g).float()))
    v = v.clamp(-E4M3FN.max, E4M3FN.max)
    assert torch.equal(rne_e4m3_reference(v), v.to(torch.float8_e4m3fn).view(torch.uint8))


def test_triton_kernel_codes_on_every_boundary():
    """The kernel itself (interpreted here) on all values/midpoints/neighbours with scale exactly 1."""
    v = _e4m3_boundary_values()
    x = torch.cat([v, torch.tensor([E4M3FN.max])]).reshape(1, -1)  # amax 448 -> scale 1
    q = triton_quantize(x, QuantScheme(granularity="row"))
    r = quant.quantize(x, QuantScheme(granularity="row"))
    assert float(r.scale) == 1.0
    assert torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8))


@triton.jit
def _cast_fp8_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m).to(tl.float8e4nv), mask=m)


@triton.jit
def _store_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m).to(tl.bfloat16), mask=m)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@needs_interpreter
@LEDGER.xfail("triton-interp-fp8-cast")
def test_interpreter_fp8_cast_is_rne():
    x = _e4m3_boundary_values()
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _cast_fp8_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@needs_interpreter
@LEDGER.xfail("triton-interp-bf16-store")
def test_interpreter_bf16_store_is_rne():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _store_bf16_kernel[(4,)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y, x.to(torch.bfloat16))


@needs_interpreter
@LEDGER.xfail("triton-interp-bf16-dot")
def test_interpreter_bf16_dot():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-2, 3, (16, 16), generator=g).to(torch.bfloat16)
    b = torch.randint(-2, 3, (16, 16), generator=g).to(torch.bfloat16)
    c = torch.zeros(16, 16)
    _dot_kernel[(1,)](a, b, c, M=16, N=16, K=16)
    assert torch.equal(c, a.float() @ b.float())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16])
def test_interpreter_dot_on_fp8_and_fp16_is_right(dtype):
    """What the backend relies on: tl.dot of FP8 operands into fp32 is exact for small integers."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-8, 9, (16, 32), generator=g).to(dtype)
    b = torch.randint(-8, 9, (32, 16), generator=g).to(dtype)
    c = torch.zeros(16, 16)
    _dot_kernel[(1,)](a, b, c, M=16, N=16, K=32)
    assert torch.equal(c, a.float() @ b.float())


def test_ledger_entries_are_complete():
    for entry in LEDGER.KNOWN_FAILURES:
        assert set(entry) >= {"id", "backend", "applies", "what", "link", "reason", "test"}
        assert entry["link"] is None or entry["link"].startswith("https://")
