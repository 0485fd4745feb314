"""The reference FP8 MoE layer (fp8ref.spec.moe) and its bound (fp8ref.spec.moe_bounds).

The reference is checked bit for bit against a plain float64 computation on inputs where every
float64 operation of that computation is exact (power-of-two scales and router weights, small
codes), and its bound against implementations that compute as they declare.
"""

from __future__ import annotations

import pytest
import torch

from fp8ref.spec.bounds import U_FP32, Accumulation
from fp8ref.spec.compare import compare
from fp8ref.spec.moe import MoeScheme, MoeWeights, Routing, gate_up, moe_exact, moe_reference, quantize_experts
from fp8ref.spec.moe_bounds import REFERENCE_ACCURACY, MoeAccuracy, moe_error_bound
from fp8ref.spec.quant import quantize
from fp8ref.spec.schemes import QuantScheme

TENSOR = QuantScheme(granularity="tensor")
STATIC = QuantScheme(granularity="tensor", dynamic=False)
ROW = QuantScheme(granularity="row")
GROUP = QuantScheme(granularity="group", group_size=128)
BLOCK = QuantScheme(granularity="block", block=(128, 128))


def _codes(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """Random E4M3 codes of magnitude at most 8 (values m 2**e with few significant bits)."""
    v = torch.randint(-16, 17, shape, generator=gen).to(torch.float32) / 2
    return v.to(torch.float8_e4m3fn)


def _pow2(n: int, gen: torch.Generator, lo: int = -6, hi: int = -2) -> torch.Tensor:
    return torch.exp2(torch.randint(lo, hi + 1, (n,), generator=gen).to(torch.float32))


def _exact_case(seed: int):
    """A static per-tensor problem whose plain float64 computation is exact."""
    gen = torch.Generator().manual_seed(seed)
    T, K, I, E, k = 9, 40, 24, 5, 3
    w = MoeWeights(_codes(E, 2 * I, K, gen=gen), _pow2(E, gen).reshape(E, 1, 1), _codes(E, K, I, gen=gen),
                   _pow2(E, gen).reshape(E, 1, 1), STATIC, a1_scale=_pow2(E, gen, -4, 0), a2_scale=_pow2(E, gen, -3, 2))
    x = torch.randint(-64, 65, (T, K), generator=gen).to(torch.float32) / 16
    ids = torch.randint(0, E, (T, k), generator=gen)
    ids[0] = 2  # one token routed three times to one expert
    ids[ids == 4] = 3  # expert 4 gets no token
    weights = torch.exp2(-torch.randint(0, 3, (T, k), generator=gen).to(torch.float32))
    return x, w, Routing(ids, weights), MoeScheme(STATIC, STATIC, STATIC)


def _float64_moe(x, w: MoeWeights, r: Routing, scheme: MoeScheme) -> torch.Tensor:
    """The layer token by token in float64, from dequantized values (the spec's quantizer for x and h)."""
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(r.ids.shape[1]):
            e = int(r.ids[t, j])
            q1, q2 = w.expert(e)
            xq = quantize(x[t:t + 1], scheme.activation, w.a1_scale[e]).dequantize(torch.float64)
            g = xq @ q1.dequantize(torch.float64).T
            gate, up = gate_up(g, scheme.order)
            h = torch.nn.functional.silu(gate) * up
            hq = quantize(h, scheme.intermediate, w.a2_scale[e]).dequantize(torch.float64)
            y[t] += float(r.weights[t, j]) * (hq @ q2.dequantize(torch.float64).T)[0]
    return y


@pytest.mark.parametrize("seed", range(3))
def test_reference_equals_float64_computation_bit_for_bit(seed):
    x, w, r, scheme = _exact_case(seed)
    got = moe_exact(x, w, r, scheme)
    want = _float64_moe(x, w, r, scheme)
    assert torch.equal(got, want), float((got - want).abs().max())


def test_gate_up_order_is_a_parameter():
    x, w, r, scheme = _exact_case(0)
    swapped = MoeScheme(STATIC, STATIC, STATIC, order="up_gate")
    a, b = moe_exact(x, w, r, scheme), moe_exact(x, w, r, swapped)
    assert not torch.equal(a, b)
    assert torch.equal(b, _float64_moe(x, w, r, swapped))


def test_expert_map_drops_non_local_experts():
    x, w, r, scheme = _exact_case(1)
    emap = torch.tensor([0, 1, -1, 3, 4, -1])  # six global experts, global 2 and 5 elsewhere
    ids = r.ids.clone()
    ids[:, 0] = 5
    local = Routing(ids, r.weights, emap)
    kept = Routing(torch.where(ids == 5, 2, ids), r.weights * (ids != 5) * (ids != 2))
    assert torch.equal(moe_exact(x, w, local, scheme), moe_exact(x, w, kept, scheme))


def _bf16_pipeline(x, w, r, scheme):
    """What the fused Triton kernels compute: bf16 intermediates, fp32 arithmetic, bf16 pair outputs
    summed in fp32 (a correct implementation with MoeAccuracy() by construction)."""
    T, K = x.shape
    y = torch.zeros(T, K, dtype=torch.float32)
    qx = quantize(x, scheme.activation)
    from fp8ref.kernels.moe import grouped_scaled_mm  # the fp32 grouped GEMM

    hs = {}
    for t in range(T):
        for j in range(r.ids.shape[1]):
            e = int(r.ids[t, j])
            a = type(qx)(qx.data[t:t + 1], qx.scale if qx.scale.numel() == 1 else qx.scale[t:t + 1], qx.scheme)
            g = grouped_scaled_mm(a, w.expert(e)[0]).to(torch.bfloat16).float()
            gate, up = gate_up(g, scheme.order)
            hs[t, j] = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    keys = list(hs)
    hq = quantize(torch.cat([hs[k] for k in keys]), scheme.intermediate)
    for i, (t, j) in enumerate(keys):
        e = int(r.ids[t, j])
        sc = hq.scale if hq.scale.numel() == 1 else hq.scale[i:i + 1]
        o = grouped_scaled_mm(type(hq)(hq.data[i:i + 1], sc, hq.scheme), w.expert(e)[1])
        y[t] += (o[0] * r.weights[t, j]).to(torch.bfloat16).float()
    return y.to(torch.bfloat16)


@pytest.mark.parametrize("schemes", [(TENSOR, TENSOR, TENSOR), (BLOCK, GROUP, GROUP), (ROW, ROW, ROW)],
                         ids=["tensor", "block", "row"])
def test_bound_holds_for_a_bf16_pipeline_and_rejects_gate_up_swapped(schemes):
    gen = torch.Generator().manual_seed(7)
    T, K, I, E, k = 6, 160, 136, 4, 2
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
    w = quantize_experts(torch.randn(E, 2 * I, K, generator=gen) / 16, torch.randn(E, K, I, generator=gen) / 16,
                         schemes[0])
    r = Routing(torch.randint(0, E, (T, k), generator=gen), torch.rand(T, k, generator=gen))
    scheme = MoeScheme(*schemes)
    ref = moe_exact(x, w, r, scheme)
    bound = moe_error_bound(x, w, r, scheme, accuracy=MoeAccuracy(), out_dtype=torch.bfloat16)
    verdict = compare("bf16 pipeline", _bf16_pipeline(x, w, r, scheme), ref, bound)
    assert verdict.ok, verdict.message()
    swapped = moe_reference(x, w, r, MoeScheme(*schemes, order="up_gate"))
    assert not compare("gate/up swapped", swapped, ref, bound).ok


def test_reference_is_within_its_own_bound_at_float64():
    x, w, r, scheme = _exact_case(2)
    b = moe_error_bound(x, w, r, scheme, accuracy=REFERENCE_ACCURACY, out_dtype=torch.float64)
    assert compare("reference", moe_reference(x, w, r, scheme, torch.float64), moe_exact(x, w, r, scheme), b).ok


def test_a_coarser_declaration_gives_a_wider_bound():
    x, w, r, scheme = _exact_case(0)
    fine = MoeAccuracy(Accumulation.FP32, torch.float32, U_FP32, torch.float32, torch.float32, U_FP32)
    b32 = moe_error_bound(x, w, r, scheme, accuracy=fine, out_dtype=torch.float32)
    b16 = moe_error_bound(x, w, r, scheme, accuracy=MoeAccuracy(), out_dtype=torch.bfloat16)
    assert bool((b16 >= b32).all()) and bool((b16 > b32).any())


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a.update(scheme=MoeScheme(STATIC, TENSOR, STATIC)), "a1_scale"),
    (lambda a: a.update(routing=Routing(torch.full((9, 3), 7), torch.ones(9, 3))), "expert id 7"),
    (lambda a: a.update(x=torch.ones(9, 41)), "K = 40"),
    (lambda a: a.update(routing=Routing(torch.zeros(8, 3, dtype=torch.int64), torch.ones(8, 3))), "8 rows"),
])
def test_argument_errors_name_the_argument(change, message):
    x, w, r, scheme = _exact_case(0)
    args = {"x": x, "weights": w, "routing": r, "scheme": scheme}
    change(args)
    with pytest.raises((ValueError, TypeError), match=message):
        moe_reference(**args)


def test_scheme_rejects_what_the_bound_does_not_cover():
    with pytest.raises(ValueError, match="order"):
        MoeScheme(TENSOR, TENSOR, TENSOR, order="gate-up")
    with pytest.raises(ValueError, match="static scheme is per tensor"):
        MoeScheme(TENSOR, QuantScheme(dynamic=False), TENSOR)
    with pytest.raises(ValueError, match="pow2"):
        MoeScheme(TENSOR, TENSOR, QuantScheme(granularity="tensor", pow2_scale=True))
