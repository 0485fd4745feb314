"""Loader mutants and correct variants: ``check_loader`` must reject each mutant and accept each
variant (``test_loaders.py``).

``Fused`` is the correct base, shaped like a serving stack's fused linear: ``create`` allocates the
rank's fused parameters with ``torch.empty`` (the checks poison it), ``load`` writes each partition
at its offset (the weight loader), ``process`` post-processes. An online base holds the
full-precision shard and quantizes each partition in ``process``; an offline base copies the
checkpoint's codes and the scales that cover the rank's rows and columns. Every mutant puts back
one real loading bug (``upstream`` cites the report of its class, ``trigger`` says which layouts
expose it); every correct variant does something differently and rightly.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from fp8ref.check.loading import WeightLoader
from fp8ref.spec.loading import Loaded, source_slices
from fp8ref.spec.quant import compute_scale, quantize, round_to_format
from fp8ref.spec.schemes import QuantScheme

TENSOR = QuantScheme(granularity="tensor")
ROW = QuantScheme(granularity="row")
BLOCK = QuantScheme(granularity="block", block=(128, 128))

#: The bug classes of issue 41 ("Certify how weights are loaded").
LOAD_CLASSES = ("fused partitions with block scales", "per-shard per-tensor scales", "tensor-parallel sharding",
                "reload and post-processing", "in-place scale re-layout", "source dtypes")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fused(WeightLoader):
    """The correct base: per-partition scales (tensor: ``[P]``; row: ``[n]``; block: each partition's
    checkpoint block rows, read through ``scale_rows``)."""

    name = "correct-fused"
    upstream = ""
    trigger = ""
    bug = "per-partition scales, every partition at its own offset"

    def __init__(self, scheme: QuantScheme = ROW, offline: bool = False) -> None:
        self.scheme, self.offline = scheme, offline
        g = scheme.granularity.value
        self.name = f"{type(self).name}-{g}-{'offline' if offline else 'online'}"

    # -- layout of the block scales: partition p's checkpoint block rows covering the rank's rows

    def _block_rows(self, layout, p: int) -> tuple[int, int]:
        br = self.scheme.block[0]
        rs = layout.row_slice(p)
        if not self.offline:
            return 0, _cdiv(layout.local_partitions[p], br)
        return rs.start // br, _cdiv(rs.stop, br)

    def _block_cols(self, layout) -> tuple[int, int]:
        bc = self.scheme.block[1]
        cs = layout.col_slice()
        if not self.offline:
            return 0, _cdiv(layout.local_k, bc)
        return cs.start // bc, _cdiv(cs.stop, bc)

    def _slots(self, layout, p: int) -> int:
        """Scale rows reserved for partition p (the padded variant reserves more); block scales only."""
        if self.scheme.block is None:
            return 0
        b0, b1 = self._block_rows(layout, p)
        return b1 - b0

    def create(self, layout):
        n, k = layout.shape
        st = SimpleNamespace()
        st.weight = torch.empty(n, k, dtype=self.scheme.format.torch_dtype)
        st.hp = None
        g = self.scheme.granularity.value
        if g == "tensor":
            st.scale = torch.empty(len(layout.partitions), dtype=torch.float32)
        elif g == "row":
            st.scale = torch.empty(n, dtype=torch.float32)
        else:
            c0, c1 = self._block_cols(layout)
            st.scale = torch.empty(sum(self._slots(layout, p) for p in range(len(layout.partitions))), c1 - c0,
                                   dtype=torch.float32)
        return st

    def load(self, st, layout, source):
        if not self.offline:
            self.load_hp(st, layout, source)
            return
        cs = layout.col_slice()
        slot = 0
        for p, off in enumerate(layout.offsets):
            rs, m = layout.row_slice(p), layout.local_partitions[p]
            st.weight[off:off + m] = source.codes[p][rs, cs]
            self.load_scale(st, layout, p, source.scales[p], slot)
            slot += self._slots(layout, p)

    def load_hp(self, st, layout, source):
        st.hp = torch.empty(layout.shape, dtype=source.weights[0].dtype)
        for off, w in zip(layout.offsets, source_slices(layout, source.weights), strict=True):
            st.hp[off:off + w.shape[0]] = w

    def load_scale(self, st, layout, p, scale, slot):
        """The checkpoint's scales of partition p that cover the rank's rows and columns."""
        g = self.scheme.granularity.value
        if g == "tensor":
            own = scale.reshape(())
        elif g == "row":
            own = scale.reshape(-1)[layout.row_slice(p)]
        else:
            (b0, b1), (c0, c1) = self._block_rows(layout, p), self._block_cols(layout)
            own = scale[b0:b1, c0:c1]
        self.put_scale(st, layout, p, own, slot)

    def put_scale(self, st, layout, p, own, slot):
        """Store partition p's scales (``own``: the rank's, in the scheme's shape) in its place."""
        g = self.scheme.granularity.value
        off, m = layout.offsets[p], layout.local_partitions[p]
        if g == "tensor":
            st.scale[p] = own.reshape(())
        elif g == "row":
            st.scale[off:off + m] = own.reshape(-1)
        else:
            st.scale[slot:slot + own.shape[0]] = own

    def process(self, st, layout):
        if self.offline:
            return
        slot = 0
        for p, off in enumerate(layout.offsets):
            m = layout.local_partitions[p]
            q = quantize(st.hp[off:off + m], self.scheme)
            st.weight[off:off + m] = q.data
            self.put_scale(st, layout, p, q.scale, slot)
            slot += self._slots(layout, p)

    def _row_map(self, layout) -> torch.Tensor:
        br = self.scheme.block[0]
        rows, slot = [], 0
        for p in range(len(layout.partitions)):
            rs = layout.row_slice(p)
            b0, _ = self._block_rows(layout, p)
            local = torch.arange(layout.local_partitions[p])
            start = rs.start if self.offline else 0
            rows.append(slot + (local + start) // br - b0)
            slot += self._slots(layout, p)
        return torch.cat(rows)

    def _col_map(self, layout) -> torch.Tensor:
        bc = self.scheme.block[1]
        c0, _ = self._block_cols(layout)
        start = layout.col_slice().start if self.offline else 0
        return (torch.arange(layout.local_k) + start) // bc - c0

    def read(self, st, layout):
        if self.scheme.granularity.value == "block":
            return Loaded(st.weight, st.scale, scale_rows=self._row_map(layout), scale_cols=self._col_map(layout))
        return Loaded(st.weight, st.scale)


# --------------------------------------------------------------------------------------------
# correct variants


class PaddedScaleRows(Fused):
    name = "correct-padded-scale-rows"
    bug = "reserves one more scale row per partition than it needs; the padding is allocated, never written, never read"

    def _slots(self, layout, p):
        return super()._slots(layout, p) + 1


class MaxRequant(Fused):
    name = "correct-max-requant"
    bug = ("per-tensor: requantizes every partition's codes to the largest partition scale in process (vLLM's "
           "requantize_with_max_scale) and keeps one scale; reload-safe: it always starts from the loaded [P] scales")

    def create(self, layout):
        st = super().create(layout)
        st.loaded = st.scale  # the weight loader's target, kept apart from what the GEMM reads
        return st

    def process(self, st, layout):
        super().process(st, layout)
        st.shared = _requantize_to_max(st.weight, st.loaded, layout, self.scheme)

    def read(self, st, layout):
        return Loaded(st.weight, st.shared.reshape(1))


def _requantize_to_max(weight, scales, layout, scheme) -> torch.Tensor:
    """Dequantize each partition with its scale, requantize with the max; returns the max."""
    s_max = scales.max()
    for p, off in enumerate(layout.offsets):
        m = layout.local_partitions[p]
        v = weight[off:off + m].to(torch.float32) * scales[p] / s_max
        weight[off:off + m] = round_to_format(v, scheme.format, scheme.qmax)
    return s_max.clone()


class FusedMaxOnline(Fused):
    name = "correct-fused-tensor-scale"
    bug = "online per-tensor: quantizes the rank's whole fused weight with one scale (vLLM's online fp8)"

    def process(self, st, layout):
        q = quantize(st.hp, self.scheme)
        st.weight.copy_(q.data)
        st.shared = q.scale.reshape(1)

    def read(self, st, layout):
        return Loaded(st.weight, st.shared)


class TPAgreedPerTensor(Fused):
    name = "correct-tp-agreed-per-tensor"
    bug = ("online per-tensor at TP > 1: each partition's amax is reduced with all_reduce(MAX) over the TP group "
           "(the max of every rank's slice amax), so every rank holds the unsharded partition's scale, what TP 1 "
           "holds (vLLM's amax_for_tp_weight_quant); codes quantized with it")
    #: one scale for the whole fused weight (vLLM's online fp8_per_tensor) instead of one per partition
    fused = False

    def load(self, st, layout, source):
        super().load(st, layout, source)
        st.full = source.weights  # what the other ranks load: the collective's inputs

    def reduce(self, amaxes: list[torch.Tensor]) -> torch.Tensor:
        """The TP group's collective over every rank's amax (rank r's at index r)."""
        return torch.stack(amaxes).max()

    def _agreed_scale(self, layout, full, parts) -> torch.Tensor:
        """Every rank's slice amax over ``parts`` (rank r's computed from its slices of the full
        weights, as rank r would), reduced over the group: the scale of ``reduce``'s amax."""
        amaxes = [max(w.abs().max().to(torch.float32) for i, w in enumerate(
                      source_slices(replace(layout, tp_rank=r), full)) if i in parts)
                  for r in range(layout.tp_size)]
        return compute_scale(self.reduce(amaxes).reshape(1, 1), self.scheme).reshape(())

    def process(self, st, layout):
        static = self.scheme.with_(dynamic=False)
        groups = [range(len(layout.partitions))] if self.fused else [[p] for p in range(len(layout.partitions))]
        shared = []
        for parts in groups:
            s = self._agreed_scale(layout, st.full, set(parts))
            for p in parts:
                off, m = layout.offsets[p], layout.local_partitions[p]
                st.weight[off:off + m] = quantize(st.hp[off:off + m], static, s).data
                self.put_scale(st, layout, p, s, 0)
            shared.append(s)
        st.shared = shared[0].reshape(1).clone()

    def read(self, st, layout):
        return Loaded(st.weight, st.shared if self.fused else st.scale)


class TPAgreedFusedMax(TPAgreedPerTensor):
    name = "correct-tp-agreed-fused-tensor-scale"
    bug = ("online per-tensor at TP > 1: one scale for the rank's fused weight, its amax all-reduced (MAX) over the "
           "TP group: the whole fused weight's scale on every rank (vLLM 0.33's online fp8_per_tensor)")
    fused = True


# --------------------------------------------------------------------------------------------
# mutants


class BlockCeilOffset(Fused):
    name = "mutant-block-scale-ceil-offset"
    upstream = "vllm#52997, vllm-ascend#15346, vllm#52915 (adjust_block_scale_shard)"
    klass = "fused partitions with block scales"
    trigger = "a partition offset that is not a multiple of 128 (QKV [64, 64, 64], [192, 64, 64])"
    bug = ("allocates ceil(n/128) scale rows on the fused grid and writes partition p's block rows at "
           "ceil(offset/128): later partitions overwrite earlier rows, rows read a neighbour's scale")

    def create(self, layout):
        st = super().create(layout)
        c0, c1 = self._block_cols(layout)
        st.scale = torch.empty(_cdiv(layout.shape[0], self.scheme.block[0]), c1 - c0, dtype=torch.float32)
        return st

    def put_scale(self, st, layout, p, own, slot):
        at = _cdiv(layout.offsets[p], self.scheme.block[0])
        rows = own[:max(0, st.scale.shape[0] - at)]
        st.scale[at:at + rows.shape[0]] = rows

    def read(self, st, layout):
        return Loaded(st.weight, st.scale, scale_cols=self._col_map(layout),
                      scale_rows=torch.arange(layout.shape[0]) // self.scheme.block[0])


class BlockTailRowUnwritten(Fused):
    name = "mutant-block-tail-scale-unwritten"
    upstream = "vllm#53242 (a scale row keeps its allocation-time value)"
    klass = "fused partitions with block scales"
    trigger = "a partition whose rank rows end inside a block (size not a multiple of 128)"
    bug = ("copies floor(rows/128) scale rows per partition: a trailing partial block's scale keeps torch.empty's "
           "contents")

    def put_scale(self, st, layout, p, own, slot):
        full = layout.local_partitions[p] // self.scheme.block[0]
        st.scale[slot:slot + min(full, own.shape[0])] = own[:full]


class PerTensorCollapsed(Fused):
    name = "mutant-per-tensor-scales-collapsed"
    upstream = "vllm#38517, sglang#27588"
    klass = "per-shard per-tensor scales"
    trigger = "two partitions with different scales"
    bug = "one scale slot for the fused weight: every partition's scale is written to slot 0, the last one wins"

    def create(self, layout):
        st = super().create(layout)
        st.scale = torch.empty(1, dtype=torch.float32)
        return st

    def put_scale(self, st, layout, p, own, slot):
        st.scale[0] = own.reshape(())


class PerTensorSlotZero(Fused):
    name = "mutant-per-tensor-slot-zero"
    upstream = "vllm#47515"
    klass = "per-shard per-tensor scales"
    trigger = "a partition other than the first with a different scale"
    bug = "loads the [P] scales but hands the GEMM weight_scale[0] without requantizing the other partitions"

    def read(self, st, layout):
        return Loaded(st.weight, st.scale[:1].clone())


class RequantTwice(MaxRequant):
    name = "mutant-requantize-twice"
    upstream = "vllm#36460"
    klass = "per-shard per-tensor scales"
    trigger = "partitions with different scales"
    bug = ("requantize_with_max_scale runs twice (layer and model hooks): the second pass reads requantized codes at "
           "the old scales")

    def process(self, st, layout):
        Fused.process(self, st, layout)
        _requantize_to_max(st.weight, st.loaded, layout, self.scheme)
        st.shared = _requantize_to_max(st.weight, st.loaded, layout, self.scheme)


class ReloadNotIdempotent(MaxRequant):
    name = "mutant-reload-not-idempotent"
    upstream = "ROCm/ATOM#2028, vllm#31713"
    klass = "reload and post-processing"
    trigger = "a second load + process on one layer (a weight update)"
    bug = ("process replaces the scale parameter by the requantized max; a reload's weight loader still writes the "
           "old [P] parameter, and the second process reads the replaced one as the partitions' scales")

    def process(self, st, layout):
        Fused.process(self, st, layout)
        cur = st.scale if st.scale.numel() == len(layout.partitions) else st.scale.expand(len(layout.partitions))
        st.shared = _requantize_to_max(st.weight, cur, layout, self.scheme)
        st.scale = st.shared.reshape(1)

    def put_scale(self, st, layout, p, own, slot):
        st.loaded[p] = own.reshape(())  # bound at create: the weight loader's parameter


class RowParallelUnsharded(Fused):
    name = "mutant-row-parallel-scales-unsharded"
    upstream = "row-parallel K-group scales not sharded (issue 41's class; vLLM BlockQuantScaleParameter input_dim)"
    klass = "tensor-parallel sharding"
    trigger = "row-parallel TP > 1 at a rank > 0"
    bug = "row-parallel: the rank's codes are its K shard, its K-group scales the first ceil(K_r/128) groups"

    def load_scale(self, st, layout, p, scale, slot):
        (b0, b1), (c0, c1) = self._block_rows(layout, p), self._block_cols(layout)
        self.put_scale(st, layout, p, scale[b0:b1, :c1 - c0], slot)


class TPAgreedSum(TPAgreedPerTensor):
    name = "mutant-tp-agreed-scale-sum"
    upstream = "all_reduce(SUM) where MAX was meant (the default op of torch.distributed.all_reduce)"
    klass = "tensor-parallel sharding"
    trigger = "online per-tensor at TP > 1"
    bug = ("the TP group agrees on the per-tensor amax with all_reduce's default op, SUM: every rank holds a scale "
           "coarser than both its own and the unsharded partition's")

    def reduce(self, amaxes):
        return torch.stack(amaxes).sum()


class TPAgreedRankZero(TPAgreedPerTensor):
    name = "mutant-tp-agreed-scale-rank-zero"
    upstream = "broadcast(src=0) where all_reduce(MAX) was meant"
    klass = "tensor-parallel sharding"
    trigger = "online per-tensor at TP > 1 where rank 0's slice amax is not the partition's"
    bug = "every rank takes rank 0's per-tensor scale (a broadcast from rank 0), not the max over the TP group"

    def reduce(self, amaxes):
        return amaxes[0]


class InPlaceRelayout(Fused):
    name = "mutant-in-place-scale-relayout"
    upstream = "vllm#50204"
    klass = "in-place scale re-layout"
    trigger = "a square grid of scale blocks (e.g. [128, 128] x 256)"
    bug = ("process transposes the block scales in place for a column-major consumer (only when the grid is "
           "square, where the shape check cannot tell); the row-major GEMM reads the transposed grid")

    def process(self, st, layout):
        super().process(st, layout)
        if st.scale.dim() == 2 and st.scale.shape[0] == st.scale.shape[1]:
            st.scale.copy_(st.scale.t().clone())


class ZeroWeightsFp16(Fused):
    name = "mutant-loader-zero-weights-fp16"
    upstream = "sglang#4434"
    klass = "source dtypes"
    trigger = "an fp16 source"
    bug = ("the online loader's copy dispatch takes bf16 and fp32 only: an fp16 weight leaves the zero-initialised "
           "buffer")

    def load_hp(self, st, layout, source):
        st.hp = torch.zeros(layout.shape, dtype=source.weights[0].dtype)
        for off, w in zip(layout.offsets, source_slices(layout, source.weights), strict=True):
            if w.dtype in (torch.bfloat16, torch.float32):
                st.hp[off:off + w.shape[0]] = w


def _make(cls, scheme, offline):
    def build():
        return cls(scheme, offline)
    build.name = f"{cls.name}-{scheme.granularity.value}-{'offline' if offline else 'online'}"
    build.cls = cls
    return build


#: (factory, scheme, offline) for every mutant: the layout it lives in.
LOAD_MUTANTS = [
    _make(BlockCeilOffset, BLOCK, True), _make(BlockCeilOffset, BLOCK, False),
    _make(BlockTailRowUnwritten, BLOCK, True),
    _make(PerTensorCollapsed, TENSOR, True), _make(PerTensorSlotZero, TENSOR, True),
    _make(RequantTwice, TENSOR, True), _make(ReloadNotIdempotent, TENSOR, True),
    _make(RowParallelUnsharded, BLOCK, True), _make(InPlaceRelayout, BLOCK, True),
    _make(ZeroWeightsFp16, ROW, False), _make(ZeroWeightsFp16, TENSOR, False),
    _make(TPAgreedSum, TENSOR, False), _make(TPAgreedRankZero, TENSOR, False),
]
LOAD_CORRECT = [
    _make(Fused, s, off) for s in (TENSOR, ROW, BLOCK) for off in (False, True)
] + [_make(PaddedScaleRows, BLOCK, True), _make(PaddedScaleRows, BLOCK, False), _make(MaxRequant, TENSOR, True),
     _make(FusedMaxOnline, TENSOR, False), _make(TPAgreedPerTensor, TENSOR, False),
     _make(TPAgreedFusedMax, TENSOR, False)]
