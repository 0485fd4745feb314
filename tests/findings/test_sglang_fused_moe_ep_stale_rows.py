"""SGLang 0.5.23 fused MoE (Triton runner), expert parallelism with dynamic per-tensor FP8
activation scales: the activation skips the rows of (token, expert) pairs whose expert lives on
another rank (topk id -1: ``_activation_row_filter`` passes ``expert_ids=topk_ids`` to the gated
activation under ``filter_expert``), so those rows of ``intermediate_cache2`` keep whatever the
allocator left there (``torch.empty``); the second GEMM then quantizes the *whole* buffer per tensor
(``invoke_fused_moe_kernel`` -> ``scaled_fp8_quant(A, None)``: an amax over every row, as SGLang's
own fallback ``_native_dynamic_per_tensor_quant_fp8`` writes it, ``input.abs().max()``), so stale
data sets the scale of the rank's real pairs.

Found by ``fp8ref.conformance.moe.check_moe`` on ``sglang-fused-moe`` (scheme tensor-dynamic, sweep
item T6K40I24E4k2-random-ep): with the buffers NaN-poisoned every output is NaN. Standalone
reproduction, no fp8ref: SGLang's Triton ``act_and_mul_triton`` with the same row filter, in
Triton's CPU interpreter; the buffer holds finite stale values. The CUDA ``silu_and_mul`` row filter
has the same contract (read from source, not run here: no GPU). Fails today (strict xfail).
``python tests/findings/test_sglang_fused_moe_ep_stale_rows.py`` runs it and exits 1.
"""

import importlib.machinery
import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("sglang")
pytest.importorskip("triton")


class _Anything(types.ModuleType):
    def __getattr__(self, attr):  # every name SGLang's vision code imports: an inert placeholder
        return type(attr, (), {})


def _stub(name: str) -> None:
    mod = _Anything(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []
    sys.modules[name] = mod


def _kernels():
    # torchvision (a CUDA build for another torch) and DeepGEMM are imported by SGLang's config and
    # GEMM packages and unused here: stand-ins are enough.
    try:
        __import__("torchvision")
    except Exception:
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
            _stub(name)
    name = "sglang.srt.layers.deep_gemm_wrapper"
    try:
        __import__(name)
    except Exception:
        sys.modules[name] = types.SimpleNamespace(ENABLE_JIT_DEEPGEMM=False)
    import sglang.kernels.ops.moe.fused_moe_triton_kernels as kernels

    return kernels


@pytest.mark.xfail(strict=True, reason="sglang-fused-moe-ep-stale-rows: no upstream report found")
def test_rows_of_other_ranks_experts_do_not_set_the_intermediate_scale():
    kernels = _kernels()
    I = 8
    topk_ids = torch.tensor([[0, -1], [1, -1]], dtype=torch.int32)  # slot 1: experts of another rank
    # fp32 buffers (SGLang's are bf16): the row filter does not depend on the dtype, and Triton's
    # interpreter mishandles bf16 arithmetic (fp8ref patches it for its certificates; not here)
    cache1 = torch.randn(4, 2 * I, generator=torch.Generator().manual_seed(0))
    cache1[1] = cache1[3] = 0  # the up GEMM writes zeros for expert -1 blocks
    cache2 = torch.full((4, I), 1000.0)  # stale data from an earlier layer
    kernels.act_and_mul_triton(cache1, cache2, {"BLOCK_SIZE_M": 16}, topk_ids=topk_ids, activation="silu")
    valid = topk_ids.view(-1) >= 0
    assert bool((cache2[valid] != 1000.0).all())  # this rank's rows were computed
    amax_used = cache2.abs().max()  # what the dynamic per-tensor quantizer of the down GEMM reads
    amax_valid = cache2[valid].abs().max()
    assert amax_used == amax_valid, (f"per-tensor amax {amax_used.item()} from stale rows of other ranks' pairs, "
                                     f"{amax_valid.item()} from this rank's: scale {amax_used.item() / 448:.3g} "
                                     f"instead of {amax_valid.item() / 448:.3g}")


if __name__ == "__main__":  # run standalone: the failures show (--runxfail), exit status 1
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--runxfail"]))
