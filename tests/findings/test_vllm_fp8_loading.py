"""vLLM 0.33.0 FP8 weight loading (``vllm/model_executor/layers/linear.py``,
``.../quantization/utils/w8a8_utils.py``). Standalone reproductions, no fp8ref; they fail today
(strict xfail). ``python tests/findings/test_vllm_fp8_loading.py`` runs them and exits 1.

1. Block-quantized fused layers whose partition sizes are not multiples of block_n (128): the
   fused ``weight_scale_inv`` has ``ceil(sum(N_p) / 128)`` rows and partition p's scale rows are
   placed at ``ceil(offset_p / 128)`` (``adjust_block_scale_shard``). With QKV / gate-up partitions
   [64, 64, 64] partitions 1 and 2 write the same scale row and partition 1's rows read partition
   0's scale; with [64, 64] partition 1's scale row lies past the allocation (the load raises).
   ``MergedColumnParallelLinear`` allows such partitions (``allow_fp8_block_shape_mismatch``).
2. ``requantize_with_max_scale`` dequantizes each partition in fp16 (``per_tensor_dequantize``:
   ``tensor.to(torch.float16) * inv_scale``, a 0-dim scale keeps fp16): a third rounding between
   the checkpoint's codes and the requantized ones, off by more than one requantization where the
   dequantized weight is below fp16's normal range (|w| < 6.1e-5) and infinite above 65504.
3. Online per-tensor quantization (``quantization="fp8_per_tensor"``, ``online/fp8.py``
   ``Fp8PerTensorOnlineLinearMethod``) takes ``s = amax / 448`` with no floor: an all-zero weight
   gets scale 0, and the static quantizer's ``x * (1 / s)`` = NaN clamps to code 448 (``fminf``).
   448 x 0 dequantizes to 0, but a stored scale of 0 breaks any consumer that divides by it.
"""

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vllm (docs/certified.md, 'Installing the peers')", allow_module_level=True)
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # before vllm is imported: else it disables Triton on a CPU
pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.model_executor.layers.linear import adjust_block_scale_shard  # noqa: E402
from vllm.model_executor.layers.quantization.utils.w8a8_utils import per_tensor_dequantize  # noqa: E402


def _scale_rows(partitions, block=128):
    """(allocated rows, [(start, size)] per partition) as vLLM's merged weight loader places block scales."""
    allocated = -(-sum(partitions) // block)
    out, offset = [], 0
    for n in partitions:
        size, start = adjust_block_scale_shard([block, block], n, offset)
        out.append((start, size))
        offset += n
    return allocated, out


@pytest.mark.xfail(strict=True, reason="vllm-block-scale-ceil-offset: the vllm#52997 class")
def test_partitions_not_multiples_of_the_block_get_their_own_scale_rows():
    allocated, rows = _scale_rows([64, 64, 64])
    # partition 1's rows 64..127 are read with fused scale row 64 // 128 = 0: partition 0's
    assert rows[1][0] == 64 // 128, f"partition 1 writes scale row {rows[1][0]}, its rows read row {64 // 128}"
    assert len({r for r, _ in rows}) == 3, f"partitions write overlapping scale rows {rows}"


@pytest.mark.xfail(strict=True, reason="vllm-block-scale-ceil-offset: the vllm#52997 class")
def test_two_half_block_partitions_fit_the_allocation():
    allocated, rows = _scale_rows([64, 64])
    start, size = rows[1]
    assert start + size <= allocated, f"partition 1's scale rows [{start}, {start + size}) past {allocated} allocated"


@pytest.mark.xfail(strict=True, reason="vllm-requantize-fp16-dequantize: no upstream report found")
def test_requantize_dequantizes_without_an_fp16_rounding():
    code = torch.tensor([[0.015625]]).to(torch.float8_e4m3fn)  # an E4M3 subnormal code
    scale = torch.tensor(7.915496826171875e-05)  # a per-tensor checkpoint scale (fp32)
    dq = per_tensor_dequantize(code, scale)
    exact = 0.015625 * 7.915496826171875e-05
    assert dq.dtype != torch.float16 and float(dq[0, 0]) == exact, (
        f"dequantized {float(dq[0, 0])!r} ({dq.dtype}); the product is {exact!r}")


@pytest.mark.xfail(strict=True, reason="vllm-requantize-fp16-dequantize: no upstream report found")
def test_requantize_dequantize_does_not_overflow():
    code = torch.tensor([[448.0]]).to(torch.float8_e4m3fn)
    dq = per_tensor_dequantize(code, torch.tensor(256.0))  # a weight of 114688: finite in bf16 and fp32
    assert bool(torch.isfinite(dq).all()), f"dequantized {float(dq[0, 0])}"


@pytest.mark.xfail(strict=True, reason="vllm-online-per-tensor-zero-scale: no upstream report found")
def test_online_per_tensor_scale_of_an_all_zero_weight_is_positive():
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_scale
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    weight = torch.zeros(32, 16, dtype=torch.bfloat16)  # what process_weights_after_loading computes, TP 1
    scale = _fp8_scale(weight_amax(weight).reshape(1))
    assert float(scale) > 0, f"scale {float(scale)} for an all-zero weight"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "--runxfail"]) != 0)
