"""vLLM's FP8 checkpoint loading (``vllm`` 0.33.0) as loaders: ``MergedColumnParallelLinear``,
``QKVParallelLinear`` and ``RowParallelLinear`` built with ``Fp8Config(is_checkpoint_fp8_serialized=True)``,
each partition's checkpoint weight and scale given to the parameters' own ``weight_loader`` (v2:
``BlockQuantScaleParameter``, ``PerTensorScaleParameter``), then
``Fp8LinearMethod.process_weights_after_loading``.

Read from ``vllm/model_executor/layers/linear.py``, ``parameter.py``, ``quantization/fp8.py`` and
``quantization/utils/fp8_utils.py``:

* block (``weight_block_size=[128, 128]``): ``weight_scale_inv`` is allocated
  ``[ceil(sum(N_p / tp) / 128), ceil(K / 128)]`` on the *fused* grid; partition p's scale rows are
  written at ``ceil(offset_p / 128)`` (``adjust_block_scale_shard``), and the GEMM reads row
  ``i // 128``. Partition sizes that are not multiples of 128 are allowed for merged layers
  (``allow_fp8_block_shape_mismatch``).
* per-tensor: ``weight_scale`` holds one slot per partition (initialised to fp32's lowest);
  ``process_fp8_weight_tensor_strategy`` requantizes every partition to the max scale
  (``requantize_with_max_scale``) and returns the weight transposed ``[K, N]``.

What runs by hand on a CPU, and why: the quantization method's constructor reads the current
``VllmConfig`` and its ``create_weights`` picks a GEMM kernel for the device (neither exists on a
CPU), so ``Fp8Config.get_quant_method`` hands the layer a method made without its constructor,
with the attributes the loading path reads, and a kernel stand-in whose own post-processing (CUDA
layouts for CUTLASS / DeepGEMM) does nothing; ``requantize_with_max_scale`` calls the CUDA op
``ops.scaled_fp8_quant`` (``vllm._C``), answered by a stand-in that computes what its kernel
computes (``cast(clamp(x * (1 / s)))``, fp32). Tensor parallelism is simulated: the TP rank and
size that ``linear.py`` and ``parameter.py`` read are patched to the layout's (vLLM's weight
loaders narrow the full checkpoint tensor themselves; no process group is needed for loading).
A reload (``load.reload_idempotent``) is vLLM's weight update: ``record_metadata_for_reloading`` at
creation, ``initialize_layerwise_reload`` before the second load (it restores the layer's loading
parameters and processes the layer once every element is loaded), ``finalize_layerwise_reload``
after it.
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from unittest import mock

import torch

from ...check.loading import WeightLoader
from ...spec.loading import Loaded
from ...spec.schemes import QuantScheme

__all__ = ["VLLMFp8CheckpointLoader", "loaders"]

_FP8 = "vllm.model_executor.layers.quantization.fp8"
BLOCK = QuantScheme(granularity="block", block=(128, 128))
TENSOR = QuantScheme(granularity="tensor")


def available() -> str | None:
    """None, or why vLLM's loading path cannot run here."""
    if not torch.cuda.is_available() and "vllm" not in sys.modules:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    try:
        import vllm.model_executor.layers.linear  # noqa: F401
        import vllm.model_executor.layers.quantization.fp8  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any import failure is the reason
        return f"vllm's linear layers do not import: {type(exc).__name__}: {exc}"
    return None



def fused_layer_reason(kind: str, parts) -> str | None:
    """Why a fused layer of ``kind`` ("qkv", "merged"; vLLM's and SGLang's classes alike) cannot hold
    the partition sizes ``parts``, or None."""
    if kind == "qkv" and (len(parts) != 3 or parts[1] != parts[2]):
        return "QKVParallelLinear holds three partitions q, k, v with len(k) == len(v)"
    if kind == "merged" and len(parts) < 2:
        return "MergedColumnParallelLinear holds two or more partitions"
    return None

class _Kernel:
    """The GEMM kernel stand-in: its weight post-processing is CUDA layout work, skipped."""

    def process_weights_after_loading(self, layer) -> None:
        return None


def _scaled_fp8_quant(x, scale=None, *args, **kwargs):
    """What vLLM's static ``scaled_fp8_quant`` kernel computes for a given scale: x * (1 / s), clamp with
    ``fminf``/``fmaxf`` (a NaN product clamps to 448: ``fmin``/``fmax`` return the number), cast."""
    inv = 1.0 / scale.to(torch.float32)
    v = x.to(torch.float32) * inv
    q = torch.fmax(torch.fmin(v, torch.tensor(448.0)), torch.tensor(-448.0)).to(torch.float8_e4m3fn)
    return q, scale


def _method(cfg, block: bool):
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    m = Fp8LinearMethod.__new__(Fp8LinearMethod)
    m.quant_config = cfg
    m.is_scale_e8m0 = False
    m.out_dtype = torch.bfloat16
    m.input_dtype = torch.bfloat16
    m.marlin_input_dtype = None
    m.use_marlin = False
    m.use_deep_gemm = False
    m.weight_block_size = [128, 128] if block else None
    m.block_quant = block
    m.act_q_static = False
    m.activation_quant_key = m.weight_quant_key = None
    return m


@contextmanager
def _vllm_cpu(layout):
    """vLLM's loading path on a CPU, at the layout's TP rank and size."""
    import vllm.model_executor.layers.linear as lin
    import vllm.model_executor.parameter as par
    from vllm import _custom_ops
    from vllm.platforms import current_platform

    with ExitStack() as stack:
        for mod in (lin, par):
            stack.enter_context(mock.patch.object(mod, "get_tensor_model_parallel_rank", lambda: layout.tp_rank))
            stack.enter_context(mock.patch.object(mod, "get_tensor_model_parallel_world_size",
                                                  lambda: layout.tp_size))
        stack.enter_context(mock.patch(f"{_FP8}.init_fp8_linear_kernel", lambda **kw: _Kernel()))
        stack.enter_context(mock.patch.object(_custom_ops, "scaled_fp8_quant", _scaled_fp8_quant))
        stack.enter_context(mock.patch.object(type(current_platform), "is_fp8_fnuz", classmethod(lambda c: False)))
        stack.enter_context(mock.patch("vllm.distributed.get_tensor_model_parallel_world_size",
                                       lambda: layout.tp_size))
        yield


class VLLMFp8CheckpointLoader(WeightLoader):
    """vLLM's FP8 checkpoint loading for one layer kind (``merged``, ``qkv`` or ``row``)."""

    offline = True
    tp_sizes = (1, 2, 4, 8)

    def __init__(self, kind: str = "merged", block: bool = True, *, aligned: bool = False) -> None:
        if kind not in ("merged", "qkv", "row"):
            raise ValueError(f"kind must be 'merged', 'qkv' or 'row', got {kind!r}")
        self.kind, self.block, self.aligned = kind, block, aligned
        self.scheme = BLOCK if block else TENSOR
        self.parallel = ("row",) if kind == "row" else ("column",)
        layer = {"merged": "MergedColumnParallelLinear", "qkv": "QKVParallelLinear", "row": "RowParallelLinear"}
        self.entry = (f"vllm.model_executor.layers.linear.{layer[kind]} + Fp8Config(is_checkpoint_fp8_serialized, "
                      f"{'weight_block_size=[128, 128]' if block else 'per-tensor'}).weight_loader_v2 + "
                      "Fp8LinearMethod.process_weights_after_loading")
        self.name = f"vllm-fp8-load-{kind}-{'block' if block else 'tensor'}{'-aligned' if aligned else ''}"

    def supports(self, layout, dtype):
        parts = layout.partitions
        if self.kind == "row" and len(parts) != 1:
            return "RowParallelLinear holds one partition"
        reason = fused_layer_reason(self.kind, parts)
        if reason:
            return reason
        if self.aligned and any(n % 128 for n in layout.local_partitions):
            return "narrowed: partitions that are multiples of 128 rows on the rank"
        if self.block and layout.parallel == "column" and layout.tp_size > 1 and any(
                (n // layout.tp_size) % 128 for n in parts):
            return "vLLM refuses a TP shard of a partition that is not a multiple of block_n 128"
        if self.block and layout.parallel == "row" and layout.tp_size > 1 and layout.local_k % 128:
            return "vLLM refuses a row-parallel K shard that is not a multiple of block_k 128"
        return None

    def create(self, layout):
        from vllm.model_executor.layers import linear as lin
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        cfg = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                        weight_block_size=[128, 128] if self.block else None)
        method = _method(cfg, self.block)
        with _vllm_cpu(layout), mock.patch.object(Fp8Config, "get_quant_method", lambda s, layer, prefix: method):
            if self.kind == "merged":
                layer = lin.MergedColumnParallelLinear(layout.k, list(layout.partitions), bias=False, quant_config=cfg,
                                                       params_dtype=torch.bfloat16, prefix="mlp.gate_up_proj")
            elif self.kind == "qkv":
                d = math.gcd(*(n // layout.tp_size for n in layout.partitions[:2]))
                layer = lin.QKVParallelLinear(layout.k, d, layout.partitions[0] // d, layout.partitions[1] // d,
                                              bias=False, quant_config=cfg, params_dtype=torch.bfloat16,
                                              prefix="self_attn.qkv_proj")
            else:
                layer = lin.RowParallelLinear(layout.k, layout.partitions[0], bias=False, quant_config=cfg,
                                              params_dtype=torch.bfloat16, prefix="mlp.down_proj")
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        record_metadata_for_reloading(layer)  # what vLLM records at model init, for weight updates
        return SimpleNamespace(layer=layer, method=method, loads=0)

    def load(self, state, layout, source):
        layer = state.layer
        scale_name = "weight_scale_inv" if self.block else "weight_scale"
        shard_ids = ["q", "k", "v"] if self.kind == "qkv" else list(range(len(layout.partitions)))
        state.loads += 1
        with _vllm_cpu(layout):
            if state.loads > 1:  # a weight update: vLLM's layerwise reload, which processes as it loads
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(layer)
            for p, (codes, scale) in enumerate(zip(source.codes, source.scales, strict=True)):
                for name, t in (("weight", codes), (scale_name, scale if self.block else scale.reshape(()))):
                    param = getattr(layer, name)
                    if self.kind == "row":
                        param.weight_loader(param, t)
                    else:
                        param.weight_loader(param, t, shard_ids[p])

    def process(self, state, layout):
        with _vllm_cpu(layout):
            if state.loads > 1:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(state.layer, None)
            else:
                state.method.process_weights_after_loading(state.layer)

    def read(self, state, layout):
        layer = state.layer
        w = layer.weight.data
        n, k = layout.shape
        if tuple(w.shape) == (k, n) and (n, k) != (k, n) or (not self.block and w.shape[0] == k and w.shape[1] == n):
            w = w.t()  # the per-tensor path hands the kernel a [K, N] view
        s = layer.weight_scale_inv.data if self.block else layer.weight_scale.data
        return Loaded(w.contiguous(), s.to(torch.float32).clone())


def loaders() -> list[WeightLoader]:
    return [VLLMFp8CheckpointLoader(kind, block) for kind in ("merged", "qkv", "row") for block in (True, False)] + [
        VLLMFp8CheckpointLoader("merged", True, aligned=True), VLLMFp8CheckpointLoader("qkv", True, aligned=True)]
