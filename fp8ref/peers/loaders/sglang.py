"""SGLang's FP8 weight loading (``sglang`` 0.5.23) as loaders: ``MergedColumnParallelLinear``
(gate-up) and ``QKVParallelLinear`` built with

* ``Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128])`` (offline block),
* ``Fp8Config(is_checkpoint_fp8_serialized=True)`` (offline per-tensor: one ``weight_scale`` slot per
  partition, then ``requantize_with_max_scale`` to the largest),
* ``Fp8Config(is_checkpoint_fp8_serialized=False)`` (``--quantization fp8`` on an fp16/bf16 checkpoint)
  and ``W8A8Fp8Config(is_checkpoint_fp8_serialized=False)`` (``--quantization w8a8_fp8`` on one: the
  seed bug sglang#4434's path), which hold the full-precision fused weight and quantize it in
  ``process_weights_after_loading`` with ``fp8_utils.input_to_float8`` (one scale for the fused
  weight: the path taken where ``cutlass_fp8_supported()`` is False, every non-CUDA device),

each partition's weight (or checkpoint weight and scale) given to the parameters' own
``weight_loader`` with its shard id, then the method's ``process_weights_after_loading``.

Read from ``sglang/srt/layers/linear.py``, ``parameter.py``, ``quantization/fp8.py``,
``quantization/w8a8_fp8.py``, ``quantization/utils.py`` and ``quantization/fp8_utils.py``:

* block: ``weight_scale_inv`` is ``[ceil(N_local / 128), ceil(K / 128)]`` on the fused grid, filled
  with fp32's lowest; partition p's rows are written at ``ceil(offset_p / 128) // tp``.
  ``Fp8LinearMethod.validate_block_quant_shapes`` refuses (ValueError at construction) a fused layer
  whose per-rank partition sizes are not multiples of 128, and a row-parallel K shard that is not:
  those layouts are declined with SGLang's reason.
* per-tensor (``cutlass_fp8_supported()`` False: every non-CUDA device, CUDA before SM89):
  ``requantize_with_max_scale`` dequantizes each partition as ``weight.to(float16) *
  scale`` (``per_tensor_dequantize``) and requantizes with ``scaled_fp8_quant``; the weight is stored
  transposed ``[K, N]``. With CUTLASS (SM89+; the ``tensor-channelwise`` rows set the method's
  ``cutlass_fp8_supported``): ``convert_to_channelwise`` expands the per-partition scales to one per
  output row ``[N, 1]``, codes untouched.

What runs by hand on a CPU, and why: the linear module resolves its TP group from the runtime's
published ``parallel`` namespace (``get_parallel()``), which exists only in a running server; the
wrapper patches the module's ``get_parallel`` to a namespace with no process group and the layout's
``tp_rank``/``tp_size``, so SGLang builds its own ``_LogicalGroup`` (its path for "a weight partition
before distributed communication is initialized") and its weight loaders narrow the full checkpoint
tensor at that rank (no process group is needed for loading). The config's ``get_quant_method``
returns the linear method it returns for a ``LinearBase`` (called directly: the real one first
imports the fused-MoE package). The parameters' weight loaders import ``model_loader.weight_utils``,
whose import chain needs ``sentencepiece`` (installed with ``--no-deps``). ``scaled_fp8_quant`` on a
non-HIP device calls sgl-kernel's CUDA ``sgl_per_tensor_quant_fp8``: a stand-in computes what its
static path computes (``cast(clamp(x * (1 / s)))``, fp32). Imports need the torchvision and
DeepGEMM stand-ins of ``fp8ref/peers/sglang.py``.

An online layer is built in its checkpoint's dtype (``params_dtype``: fp16 for sglang#4434's model);
fp32 sources, the contracts' default draw, build a float32 layer: the configs list fp16/bf16
activations, but the weight path (``input_to_float8``: amax, ``x.float() * (448 / amax)``) does not
depend on it.

Reloads (``load.reload_idempotent``) follow SGLang's weight update (``update_weights_from_disk``:
``restore_weights_before_loading`` on each method, the model's ``load_weights``, then
``process_weights_after_loading``). Block layers keep their parameter objects through
post-processing (``layer.weight.data = ...``), so the second load goes through the same weight
loaders. The per-tensor and online methods replace ``layer.weight`` by a transposed FP8 ``Parameter``
without a ``weight_loader`` and do not restore it (the base method's no-op): a model's
``load_weights`` then raises (``param.weight_loader``), so these reloads are declined with that reason
(SGLang reloads such layers with ``QuantizedRLModelLoader``, model-level, not wrapped).
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from unittest import mock

import torch

from ...check.common import Declined
from ...check.loading import WeightLoader
from ...spec.loading import Loaded
from ...spec.schemes import QuantScheme
from .vllm import _scaled_fp8_quant, fused_layer_reason

__all__ = ["SGLangFp8Loader", "loaders", "available"]

BLOCK = QuantScheme(granularity="block", block=(128, 128))
TENSOR = QuantScheme(granularity="tensor")
#: ``input_to_float8``'s scale rule, declared as ``sglang-online-w8a8`` declares it (docs/certified.md):
#: amax floored at 1e-12, multiplier 448 / amax evaluated as 448 * (1 / amax), codes x * m, scale 1 / m.
ONLINE = TENSOR.with_(amax_floor=1e-12, reciprocal_scale=True, multiplier_by_reciprocal=True, multiply_codes=True)
MODES = ("block", "tensor", "tensor-channelwise", "online", "w8a8")
_LIN = "sglang.srt.layers.linear"


def available() -> str | None:
    """None, or why SGLang's linear layers cannot be built here."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:  # before the stand-ins touch sys.modules
        return "sglang is not installed"
    try:
        from ..sglang import _stub_deep_gemm, _stub_torchvision

        _stub_torchvision()
        _stub_deep_gemm()
        import sglang.srt.layers.linear  # noqa: F401
        import sglang.srt.layers.quantization.fp8  # noqa: F401
        import sglang.srt.layers.quantization.w8a8_fp8  # noqa: F401
        import sglang.srt.model_loader.weight_utils  # noqa: F401 -- the parameters' weight loaders import it
    except Exception as exc:  # noqa: BLE001 -- any import failure is the reason
        return f"sglang's linear layers do not import: {type(exc).__name__}: {exc}"
    return None


@contextmanager
def _sglang_cpu(layout, cfg, method):
    """SGLang's loading path on a CPU, at the layout's TP rank and size."""
    import sglang.srt.layers.linear as lin
    import sglang.srt.layers.quantization.utils as qutils

    par = SimpleNamespace(tp_group=None, tp_size=layout.tp_size, tp_rank=layout.tp_rank, attn_tp_group=None,
                          attn_tp_size=layout.tp_size, attn_tp_rank=layout.tp_rank)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(lin, "get_parallel", lambda: par))
        stack.enter_context(mock.patch.object(type(cfg), "get_quant_method", lambda s, layer, prefix: method))
        stack.enter_context(mock.patch.object(qutils, "scaled_fp8_quant", _scaled_fp8_quant))
        yield


class SGLangFp8Loader(WeightLoader):
    """SGLang's FP8 loading of one fused layer kind (``merged`` or ``qkv``) in one mode (``MODES``)."""

    parallel = ("column",)
    tp_sizes = (1, 2, 4, 8)

    def __init__(self, kind: str = "merged", mode: str = "block") -> None:
        if kind not in ("merged", "qkv"):
            raise ValueError(f"kind must be 'merged' or 'qkv', got {kind!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.kind, self.mode = kind, mode
        self.offline = mode in ("block", "tensor", "tensor-channelwise")
        self.scheme = {"block": BLOCK, "tensor": TENSOR, "tensor-channelwise": TENSOR}.get(mode, ONLINE)
        self.source_dtypes = (torch.float32, torch.float16, torch.bfloat16)
        layer = {"merged": "MergedColumnParallelLinear", "qkv": "QKVParallelLinear"}[kind]
        cfg = {"block": "Fp8Config(is_checkpoint_fp8_serialized, weight_block_size=[128, 128])",
               "tensor": "Fp8Config(is_checkpoint_fp8_serialized, per-tensor)",
               "tensor-channelwise": "Fp8Config(is_checkpoint_fp8_serialized, per-tensor; CUTLASS: "
                                     "convert_to_channelwise)",
               "online": "Fp8Config(fp16/bf16 checkpoint)",
               "w8a8": "W8A8Fp8Config(fp16/bf16 checkpoint)"}[mode]
        how = "W8A8Fp8LinearMethod" if mode == "w8a8" else "Fp8LinearMethod"
        self.entry = f"sglang.srt.layers.linear.{layer} + {cfg}.weight_loader + {how}.process_weights_after_loading"
        self.name = f"sglang-fp8-load-{kind}-{mode}"

    def supports(self, layout, dtype):
        parts = layout.partitions
        reason = fused_layer_reason(self.kind, parts)
        if reason:
            return reason
        if self.mode == "block" and any(n % 128 for n in layout.local_partitions):
            return ("SGLang refuses a fused layer whose per-rank partition sizes are not multiples of block_n 128 "
                    "(validate_block_quant_shapes)")
        return None

    def _config(self):
        from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
        from sglang.srt.layers.quantization.w8a8_fp8 import W8A8Fp8Config, W8A8Fp8LinearMethod

        if self.mode == "w8a8":
            cfg = W8A8Fp8Config(is_checkpoint_fp8_serialized=False)
            method = W8A8Fp8LinearMethod(cfg)
        else:
            cfg = Fp8Config(is_checkpoint_fp8_serialized=self.offline, activation_scheme="dynamic",
                            weight_block_size=[128, 128] if self.mode == "block" else None)
            method = Fp8LinearMethod(cfg)
        # what cutlass_fp8_supported() answers off CUDA; True for the SM89+ path of per-tensor checkpoints
        method.cutlass_fp8_supported = self.mode == "tensor-channelwise"
        return cfg, method

    def create(self, layout):
        # the layer is built at the first load: an online layer holds the checkpoint's dtype
        cfg, method = self._config()
        return SimpleNamespace(layer=None, cfg=cfg, method=method, loads=0)

    def _build(self, state, layout, dtype):
        from sglang.srt.layers import linear as lin

        with _sglang_cpu(layout, state.cfg, state.method):
            if self.kind == "merged":
                return lin.MergedColumnParallelLinear(layout.k, list(layout.partitions), bias=False,
                                                      quant_config=state.cfg, params_dtype=dtype,
                                                      prefix="mlp.gate_up_proj")
            d = math.gcd(*(n // layout.tp_size for n in layout.partitions[:2]))
            return lin.QKVParallelLinear(layout.k, d, layout.partitions[0] // d, layout.partitions[1] // d,
                                         bias=False, quant_config=state.cfg, params_dtype=dtype,
                                         prefix="self_attn.qkv_proj")

    def load(self, state, layout, source):
        state.loads += 1
        if state.loads > 1:  # SGLang's weight update (update_weights_from_disk) restores, then loads again
            state.method.restore_weights_before_loading(state.layer)
            if not hasattr(state.layer.weight, "weight_loader"):
                raise Declined("SGLang's weight update reaches a weight that process_weights_after_loading replaced "
                               "by a transposed FP8 Parameter without weight_loader (restore_weights_before_loading "
                               "is a no-op here): update_weights_from_disk raises; its reload of these layers is "
                               "QuantizedRLModelLoader (model-level)")
        if state.layer is None:
            dtype = source.weights[0].dtype if not self.offline else torch.bfloat16
            state.layer = self._build(state, layout, dtype)
        layer = state.layer
        shard_ids = ["q", "k", "v"] if self.kind == "qkv" else list(range(len(layout.partitions)))
        with _sglang_cpu(layout, state.cfg, state.method):
            for p in range(len(layout.partitions)):
                if self.offline:
                    scale = source.scales[p]
                    pairs = [("weight", source.codes[p]),
                             ("weight_scale_inv" if self.mode == "block" else "weight_scale",
                              scale if self.mode == "block" else scale.reshape(()))]
                else:
                    pairs = [("weight", source.weights[p])]
                for name, t in pairs:
                    param = getattr(layer, name)
                    param.weight_loader(param, t, shard_ids[p])

    def process(self, state, layout):
        with _sglang_cpu(layout, state.cfg, state.method):
            state.method.process_weights_after_loading(state.layer)

    def read(self, state, layout):
        layer = state.layer
        w = layer.weight.data
        if self.mode == "block":
            return Loaded(w.contiguous(), layer.weight_scale_inv.data.to(torch.float32).clone())
        s = layer.weight_scale.data.to(torch.float32).reshape(-1).clone()
        if self.mode == "tensor-channelwise":  # one scale per output row ([N, 1]), its partition's
            n, k = layout.shape
            return Loaded(w.t().contiguous(), s, scale_rows=torch.arange(n),
                          scale_cols=torch.zeros(k, dtype=torch.long))
        return Loaded(w.t().contiguous(), s)


def loaders() -> list[WeightLoader]:
    return [SGLangFp8Loader(kind, mode) for mode in MODES for kind in ("merged", "qkv")]
