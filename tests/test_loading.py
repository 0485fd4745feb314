"""The Loading rule (docs/spec.md §8) on its own, and fp8ref's own loading paths certified by
``check_loader``: ``quantize_model`` for each recipe (online) and ``save_fp8_dynamic`` +
``load_fp8_dynamic`` (offline)."""

import pytest
import torch

from fp8ref.conformance import check_loader
from fp8ref.peers.loaders.own import loaders
from fp8ref.spec.loading import Loaded, LoadLayout, entry_index, expectation, loaded_error_bound
from fp8ref.spec.quant import quantize
from fp8ref.spec.schemes import QuantScheme

TENSOR = QuantScheme(granularity="tensor")
BLOCK = QuantScheme(granularity="block", block=(128, 128))


@pytest.mark.parametrize("loader", loaders(), ids=lambda l: l.name)
def test_fp8ref_loaders_certified(loader):
    report = check_loader(loader, "ci", seed=0)
    assert report.passed, report.to_text()


def _weights(parts, k, scales):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g) * s for n, s in zip(parts, scales, strict=True)]


def test_shared_scale_must_be_the_max_and_codes_requantized():
    lay = LoadLayout((4, 4), 8, TENSOR)
    w = _weights(lay.partitions, 8, (1.0, 16.0))
    exp = expectation(lay, w)
    big = quantize(torch.cat(w), TENSOR)  # the whole fused weight with one scale: the max
    s2, rows, cols = entry_index(lay, Loaded(big.data, big.scale.reshape(1)))
    lo, hi, bound = loaded_error_bound(exp, rows.reshape(-1, 1) * s2.shape[1] + cols.reshape(1, -1))
    e = s2[rows][:, cols].double()
    assert bool(((e >= lo) & (e <= hi)).all())
    assert bool(((big.data.double() * e - exp.x).abs() <= bound).all())
    # partition 0's own codes read with the shared (max) scale: 16x too large, outside
    own0 = quantize(w[0], TENSOR)
    err = (own0.data.double() * e[:4] - exp.x[:4]).abs()
    assert bool((err > bound[:4]).any())


def test_block_grid_is_per_partition():
    lay = LoadLayout((64, 64), 128, BLOCK)
    w = _weights(lay.partitions, 128, (1.0, 8.0))
    exp = expectation(lay, w)
    # partition 1's rows are a block of their own: own scale from partition 1 alone
    own1 = quantize(w[1], BLOCK).scale.double()
    assert torch.equal(exp.own_hi[64:, 0], own1[0, 0].expand(64)) or bool((exp.own_hi[64:, 0] >= own1[0, 0]).all())
    assert float(exp.own_lo[0, 0]) < float(exp.own_lo[64, 0])


def test_layout_errors():
    with pytest.raises(ValueError, match="partitions"):
        LoadLayout((), 8, TENSOR)
    with pytest.raises(ValueError, match="parallel"):
        LoadLayout((4,), 8, TENSOR, parallel="diagonal")
    with pytest.raises(ValueError, match="row parallel"):
        LoadLayout((4,), 6, TENSOR, tp_size=4, parallel="row")
    with pytest.raises(ValueError, match="tensor, row or block"):
        LoadLayout((4,), 8, QuantScheme(granularity="group", group_size=4))
    with pytest.raises(ValueError, match="fits no reading"):
        entry_index(LoadLayout((4, 4), 8, TENSOR), Loaded(torch.zeros(8, 8, dtype=torch.float8_e4m3fn),
                                                          torch.ones(3)))


def _judged(lay, w, data, scale):
    """(in interval, within bound) of every element of a loaded shard under the Loading rule."""
    exp = expectation(lay, w)
    held = Loaded(data, scale)
    s2, rows, cols = entry_index(lay, held)
    e = s2[rows][:, cols].double()
    lo, hi, bound = loaded_error_bound(exp, rows.reshape(-1, 1) * s2.shape[1] + cols.reshape(1, -1), e)
    return bool(((e >= lo) & (e <= hi)).all()), bool(((data.double() * e - exp.x).abs() <= bound).all())


def test_tp_agreed_per_tensor_scale_is_the_unsharded_partitions_or_none():
    """§8.2: online per-tensor at TP > 1 a rank holds its own slice's scale or its unsharded
    partition's (what TP 1 holds, all_reduce(MAX)); a scale between them, a coarser one, or
    another partition's is outside."""
    static = TENSOR.with_(dynamic=False)
    lay = LoadLayout((8, 8), 16, TENSOR, tp_size=4, tp_rank=2)
    w = _weights(lay.partitions, 16, (1.0, 4.0))
    w[0][0, 0], w[1][0, 0] = 64.0, 256.0  # rank 0 holds both partitions' amax: rank 2's own scales are finer
    local = [x[lay.row_slice(p)] for p, x in enumerate(w)]

    def held(scales):
        return torch.cat([quantize(x, static, s).data for x, s in zip(local, scales, strict=True)]), scales

    own = torch.stack([quantize(x, TENSOR).scale.reshape(()) for x in local])
    whole = torch.stack([quantize(x, TENSOR).scale.reshape(()) for x in w])
    assert bool((whole > 2 * own).all())
    assert _judged(lay, w, *held(own)) == (True, True)
    assert _judged(lay, w, *held(whole)) == (True, True)        # the TP group's agreed scale
    assert not _judged(lay, w, *held(torch.sqrt(own * whole)))[0]  # between the two: neither
    assert not _judged(lay, w, *held(2 * whole))[0]               # coarser than the whole weight's
    assert not _judged(lay, w, *held(whole.flip(0)))[0]           # the other partition's
    # the agreed scale read over codes quantized with the rank's own scale: outside the bound
    codes_own = held(own)[0]
    assert _judged(lay, w, codes_own, whole) == (True, False)
