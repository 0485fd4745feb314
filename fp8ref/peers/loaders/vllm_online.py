"""vLLM's online FP8 weight quantization (``vllm`` 0.33.0) as loaders: ``MergedColumnParallelLinear``
(gate-up) and ``QKVParallelLinear`` with ``quantization="fp8_per_tensor"`` or ``"fp8_per_block"`` on
an fp16/bf16 checkpoint (``quantization/online/fp8.py``: ``Fp8PerTensorOnlineLinearMethod``,
``Fp8PerBlockOnlineLinearMethod``). ``quantization="fp8"`` with an unquantized checkpoint raises
in 0.33 ("no longer supports online quantization ... use fp8_per_tensor"): these methods are its
successors.

Read from ``online/fp8.py``, ``online/base.py``, ``utils/quant_utils.py``, ``vllm/utils/deep_gemm.py``
and ``model_loader/reload/layerwise.py``:

* the weight is created on the meta device and ``initialize_online_processing`` wraps its weight
  loader: the first shard materializes it, and once every element is loaded the layer's
  ``process_weights_after_loading`` runs (layerwise), then sets
  ``_already_called_process_weights_after_loading``.
* per-tensor: ``amax = max |W|`` of the rank's fused weight, reduced with ``all_reduce(MAX)`` over the
  TP group when the layer is sharded (``amax_for_tp_weight_quant``: "each shard derives the same scale
  it would as part of the whole weight"); ``s = amax / 448`` (true division), codes
  ``scaled_fp8_quant(W, s)``; the weight is stored transposed ``[K, N]``.
* per-block: ``per_block_cast_to_fp8`` on the rank's fused weight: 128 x 128 blocks of the *fused*
  grid, ``amax`` floored at 1e-4, ``s = amax / 448``, codes ``cast(x * (1 / s))``.

What runs by hand on a CPU, and why: as for vLLM's checkpoint loading (``vllm.py`` of this package),
the method is made without its constructor (it reads the current ``VllmConfig``), the GEMM kernel is
a stand-in whose post-processing does nothing, and ``ops.scaled_fp8_quant`` is the stand-in of
``vllm.py``. ``per_block_cast_to_fp8`` is ``torch.compile``d; it runs eagerly here (its
``__wrapped__`` function: the same torch ops), because inductor's tracing on a CPU goes through the
checks' poisoned ``torch.empty`` and fails. The TP rank and size are patched; the
``all_reduce(MAX)`` of the amax has no peers in one process (a one-process gloo group would return
the rank's own amax, not what TP ranks agree on), so the wrapper answers it with what the collective
returns: the max of every rank's amax, each rank's computed here from its own fused shard of the
full partitions (the rows rank r's weight loader would keep), as rank r computes it. A rank whose
own shard has a smaller amax then holds the unsharded weight's scale, the one TP 1 holds, which
docs/spec.md §8.2 admits ("A scale agreed over the TP group"). A reload is vLLM's layerwise weight
update, as for the checkpoint loaders.
"""

from __future__ import annotations

import importlib
import math
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import torch

from ...check.loading import WeightLoader
from ...spec.loading import Loaded, source_slices
from ...spec.schemes import QuantScheme
from .vllm import _Kernel, _vllm_cpu, fused_layer_reason

__all__ = ["VLLMOnlineFp8Loader", "loaders"]

_ONLINE = "vllm.model_executor.layers.quantization.online.fp8"
#: ``s = amax / 448`` true division; ``scaled_fp8_quant`` codes ``x * (1 / s)`` (the static kernel).
TENSOR = QuantScheme(granularity="tensor", amax_floor=0.0, multiply_codes=True)
#: ``per_block_cast_to_fp8``: amax floored at 1e-4, ``s = amax / 448``, codes ``x * (1 / s)``.
BLOCK = QuantScheme(granularity="block", block=(128, 128), amax_floor=1e-4, multiply_codes=True)


def _method(block: bool):
    from vllm.model_executor.layers.quantization.online.fp8 import (
        Fp8PerBlockOnlineLinearMethod,
        Fp8PerTensorOnlineLinearMethod,
    )

    cls = Fp8PerBlockOnlineLinearMethod if block else Fp8PerTensorOnlineLinearMethod
    m = cls.__new__(cls)
    m.requantization_source = None
    m.requantization_source_parameters = {}
    m.uses_meta_device = True
    m.out_dtype = torch.bfloat16
    m.input_dtype = torch.bfloat16
    m.block_quant = block
    m.use_deep_gemm = False
    m.use_marlin = False
    m.marlin_input_dtype = None
    m.weight_quant_key = None  # read only by the GEMM kernel choice, patched out
    if block:
        m.weight_block_size = [128, 128]
    return m


@contextmanager
def _online_cpu(layout, amax_all):
    with ExitStack() as stack:
        stack.enter_context(_vllm_cpu(layout))
        stack.enter_context(mock.patch(f"{_ONLINE}.init_fp8_linear_kernel", lambda **kw: _Kernel()))
        cast = importlib.import_module(_ONLINE).per_block_cast_to_fp8
        stack.enter_context(mock.patch(f"{_ONLINE}.per_block_cast_to_fp8", getattr(cast, "__wrapped__", cast)))
        stack.enter_context(mock.patch(f"{_ONLINE}.amax_for_tp_weight_quant",
                                       lambda amax, sharded: amax_all().reshape(amax.shape) if sharded else amax))
        yield


class VLLMOnlineFp8Loader(WeightLoader):
    """vLLM's online FP8 quantization (``fp8_per_tensor`` or ``fp8_per_block``) of one fused layer kind."""

    offline = False
    parallel = ("column",)
    tp_sizes = (1, 2, 4, 8)
    source_dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def __init__(self, kind: str = "merged", block: bool = False) -> None:
        if kind not in ("merged", "qkv"):
            raise ValueError(f"kind must be 'merged' or 'qkv', got {kind!r}")
        self.kind, self.block = kind, block
        self.scheme = BLOCK if block else TENSOR
        layer = {"merged": "MergedColumnParallelLinear", "qkv": "QKVParallelLinear"}[kind]
        how = "Fp8PerBlockOnlineLinearMethod" if block else "Fp8PerTensorOnlineLinearMethod"
        self.entry = (f"vllm.model_executor.layers.linear.{layer} + quantization="
                      f"'fp8_{'per_block' if block else 'per_tensor'}' ({how}, fp16/bf16 checkpoint)")
        self.name = f"vllm-online-fp8-load-{kind}-{'block' if block else 'tensor'}"

    def supports(self, layout, dtype):
        return fused_layer_reason(self.kind, layout.partitions)

    def create(self, layout):
        return SimpleNamespace(layer=None, method=_method(self.block), loads=0, weights=None)

    def _amax_all(self, state, layout):
        """``all_reduce(MAX)`` over the TP group of each rank's ``weight_amax`` of its fused shard."""
        ranks = (replace(layout, tp_rank=r) for r in range(layout.tp_size))
        return torch.stack([max(w.abs().max().to(torch.float32) for w in source_slices(lay, state.weights))
                            for lay in ranks]).max()

    def _build(self, state, layout, dtype):
        from vllm.model_executor.layers import linear as lin
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        cfg = Fp8Config(is_checkpoint_fp8_serialized=True)  # a QuantizationConfig whose method is patched in
        with _online_cpu(layout, lambda: self._amax_all(state, layout)), \
                mock.patch.object(Fp8Config, "get_quant_method", lambda s, layer, prefix: state.method):
            if self.kind == "merged":
                layer = lin.MergedColumnParallelLinear(layout.k, list(layout.partitions), bias=False, quant_config=cfg,
                                                       params_dtype=dtype, prefix="mlp.gate_up_proj")
            else:
                d = math.gcd(*(n // layout.tp_size for n in layout.partitions[:2]))
                layer = lin.QKVParallelLinear(layout.k, d, layout.partitions[0] // d, layout.partitions[1] // d,
                                              bias=False, quant_config=cfg, params_dtype=dtype,
                                              prefix="self_attn.qkv_proj")
        record_metadata_for_reloading(layer)
        return layer

    def load(self, state, layout, source):
        state.loads += 1
        state.weights = source.weights
        if state.layer is None:
            state.layer = self._build(state, layout, source.weights[0].dtype)
        layer = state.layer
        shard_ids = ["q", "k", "v"] if self.kind == "qkv" else list(range(len(layout.partitions)))
        with _online_cpu(layout, lambda: self._amax_all(state, layout)):
            if state.loads > 1:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(layer)
            for p, w in enumerate(source.weights):
                layer.weight.weight_loader(layer.weight, w, shard_ids[p])

    def process(self, state, layout):
        with _online_cpu(layout, lambda: self._amax_all(state, layout)):
            if state.loads > 1:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(state.layer, None)
            else:  # the layerwise wrapper has processed the layer once every element was loaded
                state.method.process_weights_after_loading(state.layer)

    def read(self, state, layout):
        layer = state.layer
        if self.block:
            return Loaded(layer.weight.data.contiguous(), layer.weight_scale_inv.data.to(torch.float32).clone())
        return Loaded(layer.weight.data.t().contiguous(), layer.weight_scale.data.to(torch.float32).reshape(-1))


def loaders() -> list[WeightLoader]:
    return [VLLMOnlineFp8Loader(kind, block) for block in (False, True) for kind in ("merged", "qkv")]
