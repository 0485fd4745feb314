"""SGLang's and vLLM's Triton fused-MoE FP8 kernels as MoE backends, run under ``TRITON_INTERPRET=1``.

Both projects run an FP8 MoE layer as: align the routed pairs into blocks of ``BLOCK_SIZE_M`` rows
per expert (``moe_align_block_size``: each expert's pairs in order, padded with the sentinel
``T * k``; pairs of experts not on this rank form a bucket whose blocks carry expert id -1, for which
the kernel writes zeros), the Triton ``fused_moe_kernel`` for w13 (activations quantized first:
per token group of 128 with the projects' Triton ``per_token_group_quant_fp8``, or per tensor /
per token), SiLU-and-mul into a bf16 buffer, the kernel again for w2 with the intermediate
re-quantized and the router weight multiplied into the fp32 accumulator before its bf16 store
(``MUL_ROUTED_WEIGHT``), and a top-k sum.

What runs here is the projects' code except where their CPU build has none (docs/certified.md,
"MoE harness"): the alignment (a CUDA op in both) is ``align_block_size`` below, written from the
projects' docstring; the per-tensor and per-token quantizers (sgl-kernel / vLLM ``_C`` CUDA ops)
are the spec's quantizer; vLLM's SiLU-and-mul and sum are its ``SiluAndMul.forward_native`` and
``torch.sum`` (its CUDA ops' CPU stand-ins). SGLang's activation (``act_and_mul_triton``) and sum
(``moe_sum_reduce_triton``) are its own Triton kernels. The intermediate buffers are NaN-filled
before the kernels write them, so a row a kernel should write and does not, or reads and should not,
shows.

Declarations: GEMMs accumulate in fp32 (``tl.dot`` is a numpy fp32 matmul in the interpreter), g and
h are stored in bf16, SGLang's activation rounds silu(gate) to bf16 before the product (so the
activation's unit roundoff is bf16's), the weighted pair outputs are stored in bf16 and summed in
fp32.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..check.common import Declined
from ..registry import MoeBackend
from ..spec.bounds import U_FP32, Accumulation
from ..spec.formats import E4M3FN
from ..spec.moe import MoeScheme, MoeWeights, Routing, check_moe_args
from ..spec.moe_bounds import MoeAccuracy
from ..spec.schemes import Granularity
from ._base import interpreting
from .triton_interpreter import correct_downcasts

__all__ = ["align_block_size", "SGLangFusedMoe", "VLLMFusedMoe", "MOE_PEERS"]

#: The kernels' group-quantizer floor (``eps`` of ``per_token_group_quant_fp8`` in both projects).
GROUP_EPS = 1e-10


def align_block_size(local_ids: torch.Tensor, block_m: int, num_experts: int):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) as the projects' ``moe_align_block_size``
    documents them: the flat pair indices t * k + j grouped by expert in ascending order (pairs whose
    expert is not local, id -1, first), each group padded to a multiple of ``block_m`` with the
    sentinel T * k; one expert id per block (-1 for the non-local bucket)."""
    flat = local_ids.reshape(-1).to(torch.int64)
    sentinel = flat.numel()
    ids, blocks = [], []
    for e in [-1, *range(num_experts)]:
        pairs = torch.nonzero(flat == e).flatten().tolist()
        if not pairs:
            continue
        pad = -len(pairs) % block_m
        ids += pairs + [sentinel] * pad
        blocks += [e] * ((len(pairs) + pad) // block_m)
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(blocks, dtype=torch.int32),
            torch.tensor([len(ids)], dtype=torch.int32))


class _Aligned(NamedTuple):
    """The routed pairs as the kernels take them: router weights, local ids, aligned blocks."""

    weights: torch.Tensor
    ids: torch.Tensor
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    n_post: torch.Tensor


def _local_ids(routing: Routing) -> torch.Tensor:
    ids = routing.ids.to(torch.int64)
    if routing.expert_map is not None:
        ids = routing.expert_map.to(torch.int64)[ids]
    return ids.to(torch.int32).contiguous()


def _config(scheme: MoeScheme) -> dict:
    if scheme.weight.granularity is Granularity.BLOCK:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}


class _FusedMoe(MoeBackend):
    """What both projects share: the scheme checks, the buffers, the sequence."""

    distribution = ""
    accuracy = MoeAccuracy(Accumulation.FP32, torch.bfloat16, 2.0**-8, torch.float32, torch.bfloat16, U_FP32)
    #: the interpreter runs each program in Python: small operands (a count, not a clock)
    conformance_max_elems = 40 * 1024

    def available(self) -> str | None:
        if not interpreting() and not torch.cuda.is_available():
            return "no CUDA device and TRITON_INTERPRET is not 1"
        try:
            self._modules()
        except Exception as exc:
            return f"{self.distribution} does not import here: {exc!r}"
        return None

    def supports(self, scheme: MoeScheme, out_dtype: torch.dtype) -> str | None:
        if out_dtype != torch.bfloat16:
            return "the kernels compute in the activations' dtype and return it: bf16 here"
        if scheme.order != "gate_up":
            return "silu_and_mul takes the first half of w13 as the gate (gate_up) only"
        w, a, i = scheme.weight, scheme.activation, scheme.intermediate
        if any(s.format != E4M3FN or s.qmax != E4M3FN.max for s in (w, a, i)):
            return "e4m3fn clamped at 448 only"
        if w.granularity is Granularity.BLOCK:
            if w.block != (128, 128) or any(s.granularity is not Granularity.GROUP or s.group_size != 128
                                             or not s.dynamic or s.amax_floor != GROUP_EPS for s in (a, i)):
                return "block path: 128 x 128 weight blocks with dynamic 1 x 128 groups floored at eps 1e-10"
            return None
        if w.granularity is Granularity.TENSOR:
            if any(s.granularity is not Granularity.TENSOR for s in (a, i)):
                return "per-tensor weights take per-tensor activation scales"
            return None
        if w.granularity is Granularity.ROW:
            if any(s.granularity is not Granularity.ROW or not s.dynamic for s in (a, i)):
                return "per-channel weights take dynamic per-token activation scales"
            return None
        return f"weight granularity {w.granularity.value}"

    def _static(self, scale: torch.Tensor | None) -> torch.Tensor | None:
        """The one static scale the kernel takes, or raise: it has no per-expert input scales."""
        if scale is None:
            return None
        if not bool((scale == scale[0]).all()):
            raise Declined(f"{self.name}: one static input scale for all experts (the kernel reads a scalar; "
                           "the projects load the max over experts), got differing per-expert scales")
        return scale[:1].to(torch.float32).contiguous()

    def _quantize_input(self, a: torch.Tensor, scheme, static):
        """Per-tensor or per-token A quantization, as the projects' CUDA ops compute it (sgl-kernel's
        ``sgl_per_tensor_quant_fp8`` / ``sgl_per_token_quant_fp8``, vLLM's ``scaled_fp8_quant``): the
        amax over *every* row of the buffer they are given, rows no kernel wrote included (NaN here:
        it propagates as a real amax does), s = max(amax, 1e-12) / 448, codes clamp(x / s). On rows
        that hold finite values this is the spec's quantizer (``quantize``), which computes them."""
        if static is not None:
            return self._codes(a, static.reshape(1))
        if scheme.granularity is Granularity.ROW:
            amax = a.float().abs().amax(dim=1, keepdim=True)
        else:
            amax = a.float().abs().amax().reshape(1)
        s = torch.where(torch.isnan(amax), amax, torch.clamp(amax, min=scheme.amax_floor)) / E4M3FN.max
        return self._codes(a, s)

    @staticmethod
    def _codes(a: torch.Tensor, s: torch.Tensor):
        v = a.float() / (s if s.dim() == 2 else s.reshape(1, 1))
        finite = bool(torch.isfinite(a).all()) and bool(torch.isfinite(s).all())
        if finite:  # the spec's rounding and clamp, bit for bit
            from ..spec.quant import round_to_format

            return round_to_format(v, E4M3FN, E4M3FN.max).contiguous(), s.to(torch.float32).contiguous()
        return torch.clamp(v, -E4M3FN.max, E4M3FN.max).to(torch.float8_e4m3fn).contiguous(), s.contiguous()

    def moe(self, x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        check_moe_args(x, weights, routing, scheme, out_dtype)
        reason = self.supports(scheme, out_dtype)
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        a1, a2 = self._static(weights.a1_scale), self._static(weights.a2_scale)
        T, K = x.shape
        E, I = weights.num_experts, weights.intermediate_size
        if scheme.weight.granularity is Granularity.BLOCK and (K % 128 or I % 128):
            raise Declined(f"{self.name}: per_token_group_quant_fp8 asserts K % 128 == 0 and I % 128 == 0 "
                           f"(K={K}, I={I})")
        k = routing.ids.shape[1]
        x = x.to(torch.bfloat16).contiguous()
        ids = _local_ids(routing)
        cfg = _config(scheme)
        sorted_ids, expert_ids, n_post = align_block_size(ids, cfg["BLOCK_SIZE_M"], E)
        tw = routing.weights.to(torch.float32).contiguous()
        block = [128, 128] if scheme.weight.granularity is Granularity.BLOCK else None
        per_channel = scheme.weight.granularity is Granularity.ROW
        cache1 = torch.full((T * k, 2 * I), float("nan"), dtype=torch.bfloat16)
        cache2 = torch.full((T * k, I), float("nan"), dtype=torch.bfloat16)
        cache3 = torch.full((T, k, K), float("nan"), dtype=torch.bfloat16)
        w13s = weights.w13_scale.to(torch.float32).contiguous()
        w2s = weights.w2_scale.to(torch.float32).contiguous()
        if scheme.weight.granularity is Granularity.TENSOR:
            w13s, w2s = w13s.reshape(E), w2s.reshape(E)
        with correct_downcasts():
            al = _Aligned(tw, ids, sorted_ids, expert_ids, n_post)
            self._gemm(x, weights.w13.contiguous(), cache1, a1, w13s, al, mul=False, top_k=k, cfg=cfg, block=block,
                       per_channel=per_channel, scheme=scheme.activation)
            self._act(cache1, cache2, ids, cfg)
            self._gemm(cache2, weights.w2.contiguous(), cache3.view(T * k, K), a2, w2s, al, mul=True, top_k=1, cfg=cfg,
                       block=block, per_channel=per_channel,
                       scheme=scheme.intermediate)
            out = torch.full((T, K), float("nan"), dtype=torch.bfloat16)
            self._sum(cache3, out)
        return out

    # the project-specific steps
    def _modules(self):
        raise NotImplementedError

    def _gemm(self, a, b, c, a_scale, b_scale, al: _Aligned, *, mul, top_k, cfg, block, per_channel, scheme):
        raise NotImplementedError

    def _act(self, cache1, cache2, ids, cfg):
        raise NotImplementedError

    def _sum(self, cache3, out):
        raise NotImplementedError


class SGLangFusedMoe(_FusedMoe):
    """SGLang 0.5.23: ``invoke_fused_moe_kernel``, ``act_and_mul_triton``, ``moe_sum_reduce_triton``
    (``sglang/kernels/ops/moe/fused_moe_triton_kernels.py``)."""

    name = "sglang-fused-moe"
    distribution = "sglang"

    def _modules(self):
        from . import sglang as adapter

        adapter._stub_torchvision()
        adapter._stub_deep_gemm()
        import sglang.kernels.ops.moe.fused_moe_triton_kernels as kernels

        return kernels

    def _gemm(self, a, b, c, a_scale, b_scale, al: _Aligned, *, mul, top_k, cfg, block, per_channel, scheme):
        import triton.language as tl

        kernels = self._modules()
        if block is None:  # sgl-kernel's CUDA quantizer inside invoke_fused_moe_kernel: the spec's here
            a, a_scale = self._quantize_input(a, scheme, a_scale)
            original = kernels.scaled_fp8_quant
            kernels.scaled_fp8_quant = lambda A, A_scale, **kw: (A, A_scale)
        try:
            kernels.invoke_fused_moe_kernel(a, b, None, c, a_scale, b_scale, None, al.weights, al.ids, al.sorted_ids,
                                            al.expert_ids, al.n_post, mul, top_k, cfg, compute_type=tl.bfloat16,
                                            use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False,
                                            use_int4_w4a16=False,
                                            per_channel_quant=per_channel, block_shape=block)
        finally:
            if block is None:
                kernels.scaled_fp8_quant = original

    def _act(self, cache1, cache2, ids, cfg):
        self._modules().act_and_mul_triton(cache1, cache2, cfg, topk_ids=ids, activation="silu")

    def _sum(self, cache3, out):
        self._modules().moe_sum_reduce_triton(cache3, out, 1.0)


class VLLMFusedMoe(_FusedMoe):
    """vLLM 0.33.0: ``invoke_fused_moe_triton_kernel`` (``vllm/model_executor/layers/fused_moe/fused_moe.py``)
    with ``per_token_group_quant_fp8`` for the block path."""

    name = "vllm-fused-moe"
    distribution = "vllm"

    def _modules(self):
        if not torch.cuda.is_available():
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        import vllm.model_executor.layers.fused_moe.fused_moe as fm
        from vllm.model_executor.layers.quantization.utils import fp8_utils

        return fm, fp8_utils

    def _gemm(self, a, b, c, a_scale, b_scale, al: _Aligned, *, mul, top_k, cfg, block, per_channel, scheme):
        import triton.language as tl

        fm, fp8_utils = self._modules()
        if block is not None:
            a, a_scale = fp8_utils.per_token_group_quant_fp8(a, block[1])
        else:
            a, a_scale = self._quantize_input(a, scheme, a_scale)
        c3 = c.view(-1, al.ids.shape[1], c.shape[-1])  # [T, k, N]: the kernel's row stride is C.stride(1)
        fm.invoke_fused_moe_triton_kernel(a, b, c3, a_scale, b_scale, al.weights, al.sorted_ids, al.expert_ids,
                                          al.n_post, mul, top_k, cfg, compute_type=tl.bfloat16, use_fp8_w8a8=True,
                                          use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                                          per_channel_quant=per_channel, block_shape=block)

    def _act(self, cache1, cache2, ids, cfg):
        from vllm.model_executor.layers.activation import SiluAndMul

        cache2.copy_(SiluAndMul.forward_native(cache1))  # every row, as vLLM's CPU path computes it

    def _sum(self, cache3, out):
        out.copy_(torch.sum(cache3, dim=1))


MOE_PEERS = (SGLangFusedMoe, VLLMFusedMoe)
