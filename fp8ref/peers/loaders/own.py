"""fp8ref's own loading paths as loaders: ``quantize_model`` (online: each partition of the rank's
shard an ``nn.Linear``, quantized in place) and ``save_fp8_dynamic`` + ``load_fp8_dynamic``
(offline: the checkpoint's codes and row scales written to a safetensors file and read back into a
model of ``nn.Linear`` layers). fp8ref has no fused layer and no tensor parallelism: the wrapper
shards the weight (the rank's rows of every partition, or its K columns) and gives each partition
its own layer, which is how fp8ref holds it; the GEMM reads each layer's own scales.

Imports flow down: fp8ref's face (``nn``, ``checkpoint``), the spec and the checking core.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import torch
from torch import nn

from ...check.loading import WeightLoader
from ...checkpoint import load_fp8_dynamic, save_fp8_dynamic
from ...nn import Fp8Linear
from ...spec.loading import Loaded, source_slices
from ...spec.quant import Quantized
from ...spec.schemes import FP8_DYNAMIC, Granularity, get_recipe
from ...surgery import quantize_model

__all__ = ["QuantizeModelLoader", "Fp8DynamicCheckpointLoader"]


def _layers(model: nn.Module, n: int) -> list[Fp8Linear]:
    out = [getattr(model, f"p{p}") for p in range(n)]
    bad = [type(m).__name__ for m in out if not isinstance(m, Fp8Linear)]
    if bad:
        raise TypeError(f"a partition's layer is {bad[0]}, not an Fp8Linear, after loading")
    return out


def _held(layers: list[Fp8Linear], layout) -> Loaded:
    """The layers' codes stacked, and their scales as the per-layer GEMMs read them."""
    data = torch.cat([m.weight for m in layers])
    scales = [m.weight_scale for m in layers]
    g = layout.scheme.granularity
    if g is Granularity.TENSOR:
        return Loaded(data, torch.cat([s.reshape(1) for s in scales]))
    if g is Granularity.ROW:
        return Loaded(data, torch.cat([s.reshape(-1) for s in scales]))
    br, bc = layout.scheme.block
    rows, off = [], 0
    for m, s in zip(layers, scales, strict=True):
        rows.append(torch.arange(m.weight.shape[0]) // br + off)
        off += s.shape[0]
    return Loaded(data, torch.cat(scales), scale_rows=torch.cat(rows), scale_cols=torch.arange(layout.local_k) // bc)


class QuantizeModelLoader(WeightLoader):
    """``fp8ref.quantize_model`` on a model holding one ``nn.Linear`` per partition of the rank's shard."""

    offline = False

    def __init__(self, recipe: str = "w8a8_fp8") -> None:
        self.recipe = get_recipe(recipe)
        self.scheme = self.recipe.weight
        self.name = f"fp8ref-quantize-model-{self.recipe.name}"
        self.entry = f"fp8ref.quantize_model(an nn.Linear per partition of the shard, recipe={self.recipe.name!r})"

    def create(self, layout):
        return SimpleNamespace(model=None)

    def load(self, state, layout, source):
        model = nn.Module()
        for p, w in enumerate(source_slices(layout, source.weights)):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
            setattr(model, f"p{p}", lin)
        state.model = model

    def process(self, state, layout):
        quantize_model(state.model, self.recipe, skip=(), backend="reference")

    def read(self, state, layout):
        return _held(_layers(state.model, len(layout.partitions)), layout)


class Fp8DynamicCheckpointLoader(WeightLoader):
    """``save_fp8_dynamic`` of the checkpoint's rank slices, then ``load_fp8_dynamic`` into a model of
    ``nn.Linear`` layers (a reload loads into the now quantized model)."""

    offline = True
    scheme = FP8_DYNAMIC.weight
    name = "fp8ref-load-fp8-dynamic"
    entry = "fp8ref.save_fp8_dynamic(the rank slices) + fp8ref.load_fp8_dynamic(an nn.Linear per partition)"

    def create(self, layout):
        model = nn.Module()
        for p, m in enumerate(layout.local_partitions):
            setattr(model, f"p{p}", nn.Linear(layout.local_k, m, bias=False))
        return SimpleNamespace(model=model)

    def load(self, state, layout, source):
        ckpt = nn.Module()
        cs = layout.col_slice()
        for p, (codes, scale) in enumerate(zip(source.codes, source.scales, strict=True)):
            rs = layout.row_slice(p)
            q = Quantized(codes[rs, cs].contiguous(), scale[rs].contiguous(), self.scheme)
            setattr(ckpt, f"p{p}", Fp8Linear.from_quantized(q, recipe=FP8_DYNAMIC, backend="reference"))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.safetensors")
            save_fp8_dynamic(ckpt, path)
            load_fp8_dynamic(state.model, path, backend="reference")

    def read(self, state, layout):
        return _held(_layers(state.model, len(layout.partitions)), layout)


#: The rows of docs/certified-loaders.md for fp8ref itself.
def loaders() -> list[WeightLoader]:
    return [QuantizeModelLoader("w8a8_fp8"), QuantizeModelLoader("fp8"), QuantizeModelLoader("fp8_block"),
            Fp8DynamicCheckpointLoader()]
