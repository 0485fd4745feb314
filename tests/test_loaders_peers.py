"""The third-party loader rows (``fp8ref.peers.loaders``: SGLang, vLLM online and offline): every row
is named for the ledger, a project that is not installed is a decline with its reason (not a crash,
no stand-in installed), and where a project is installed one layout per wrapper runs through the
loader checks: the certified paths pass, and findings 40 and 41 fail as their ledger entries say."""

import importlib.util
import sys

import pytest
import torch

from fp8ref.check.common import ContractViolation
from fp8ref.check.loading import LoadProblem, check_load_values
from fp8ref.conformance.known_failures import KNOWN_FAILURES
from fp8ref.peers.loaders import certify_loaders, loader_names, render
from fp8ref.spec.loading import LoadLayout


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_every_loader_finding_names_a_row_and_every_project_has_rows():
    names = loader_names()
    assert {n.split("-")[0] for n in names} >= {"fp8ref", "vllm", "sglang"}
    assert {"sglang-fp8-load-merged-w8a8", "sglang-fp8-load-qkv-block", "vllm-online-fp8-load-merged-tensor",
            "vllm-online-fp8-load-qkv-block"} <= names
    loader_entries = [e for e in KNOWN_FAILURES if e.get("property", "").startswith("load.")]
    assert loader_entries and all(e["backend"] in names for e in loader_entries)


@pytest.mark.skipif(_installed("sglang"), reason="the decline path needs sglang absent")
def test_absent_sglang_is_a_decline_with_its_reason():
    had_torchvision = "torchvision" in sys.modules
    certs = certify_loaders(only=["sglang-fp8-load-merged-w8a8"])
    assert [(c.name, c.report) for c in certs] == [("sglang-fp8-load-merged-w8a8", None)]
    assert "not installed" in certs[0].reason
    assert ("torchvision" in sys.modules) == had_torchvision  # no stand-in went in
    assert "| declined: sglang is not installed |" in render(certs)


def test_a_ledger_failure_renders_as_a_known_failure_with_its_counterexample():
    from fp8ref.conformance.report import FAIL, PASS, ContractResult, Report, apply_known_failures
    from fp8ref.peers.loaders import LoaderRow

    rep = Report("vllm-fp8-load-row-tensor", "ci", 0)
    rep.results = [ContractResult("load.partitions", "bound", PASS, op="load", examples=3),
                   ContractResult("load.source_dtypes", "bound", FAIL, op="load", examples=2,
                                  counterexample="load [32]x100", message="142 elements outside")]
    rep.results[1].coverage = {"declined": {"supports: one partition": 8}}
    apply_known_failures(rep, KNOWN_FAILURES)
    text = render([LoaderRow(rep.backend, "vLLM", "0.33.0", "entry", rep)])
    assert "| **FAIL** (known, ledger) | load.source_dtypes (xfail) |" in text
    row = next(line for line in text.splitlines() if line.startswith("| load.source_dtypes | xfail"))
    assert "known failure" in row and "load [32]x100" in row and "declined" not in row


def _problem(loader, parts, k, dtype=torch.float32, tp=1, rank=0, families=None, exponents=None):
    lay = LoadLayout(tuple(parts), k, loader.scheme, tp_size=tp, tp_rank=rank, offline=loader.offline)
    n = len(parts)
    return LoadProblem(lay, dtype, families or ("normal",) * n, exponents or (0,) * n, seed=0)


needs_sglang = pytest.mark.skipif(not _installed("sglang"), reason="needs sglang (docs/certified.md)")
needs_vllm = pytest.mark.skipif(not _installed("vllm"), reason="needs vllm (docs/certified.md)")


@needs_sglang
@pytest.mark.parametrize("mode", ["block", "tensor-channelwise", "online", "w8a8"])
def test_sglang_loaders_pass_a_tp2_fp16_layout(mode):
    from fp8ref.peers.loaders.sglang import SGLangFp8Loader, available

    assert available() is None
    loader = SGLangFp8Loader("merged", mode)
    p = _problem(loader, (512, 256), 128, torch.float16, tp=2, rank=1, exponents=(-3, 2))
    assert check_load_values(loader, p) <= 1  # sglang#4434's path: an fp16 model under w8a8_fp8


@needs_sglang
def test_sglang_per_tensor_requantize_is_finding_40():
    from fp8ref.peers.loaders.sglang import SGLangFp8Loader

    loader = SGLangFp8Loader("merged", "tensor")
    p = LoadProblem(LoadLayout((64, 100, 127), 130, loader.scheme, offline=True), torch.float32,
                    ("normal",) * 3, (0, 0, 1), seed=0)
    with pytest.raises(ContractViolation, match="outside the bound"):
        check_load_values(loader, p)


@needs_vllm
def test_vllm_online_zero_weight_scale_is_finding_41():
    from fp8ref.peers.loaders.vllm_online import VLLMOnlineFp8Loader

    loader = VLLMOnlineFp8Loader("merged", block=False)
    with pytest.raises(ContractViolation, match="scale 0.0"):
        check_load_values(loader, _problem(loader, (16, 16), 16, torch.bfloat16, families=("zero", "zero")))
    assert check_load_values(loader, _problem(loader, (64, 64), 128, torch.bfloat16, exponents=(-3, 3))) <= 1


@needs_vllm
def test_vllm_online_per_tensor_tp2_agrees_the_scale_over_ranks():
    """At TP 2 vLLM's fp8_per_tensor all-reduces the amax: rank 1 holds the whole weight's scale, not
    its slice's, which docs/spec.md §8.2 admits (the scale TP 1 holds); the block method does not
    agree a scale, and its TP 2 shard passes too."""
    from fp8ref.peers.loaders.vllm_online import VLLMOnlineFp8Loader
    from fp8ref.spec.loading import entry_index, expectation, loaded_error_bound

    loader = VLLMOnlineFp8Loader("merged", block=False)
    p = _problem(loader, (64, 64), 32, torch.bfloat16, tp=2, rank=1, exponents=(0, 0))
    assert loader.supports(p.layout, p.dtype) is None
    weights = p.weights()
    weights[0][0, 0] = 1000.0  # rank 0's rows hold the outlier
    state = loader.create(p.layout)
    loader.load(state, p.layout, type("S", (), {"weights": weights})())
    loader.process(state, p.layout)
    held = loader.read(state, p.layout)
    # the collective's amax (rank 0's outlier), not rank 1's own: s = amax / 448 in fp32
    assert float(held.scale) == float(torch.tensor(1000.0) / torch.tensor(448.0))
    exp = expectation(p.layout, weights)
    s2, rows, cols = entry_index(p.layout, held)
    e = s2[rows][:, cols].double()
    lo, hi, bound = loaded_error_bound(exp, rows.reshape(-1, 1) * s2.shape[1] + cols.reshape(1, -1), e)
    assert bool((e > exp.own_hi).all())  # coarser than rank 1's own: judged as the TP-agreed scale
    assert bool(((e >= lo) & (e <= hi)).all()) and bool(((held.data.double() * e - exp.x).abs() <= bound).all())
    assert check_load_values(loader, p) <= 1
    block = VLLMOnlineFp8Loader("merged", block=True)
    q = _problem(block, (256, 128), 128, torch.bfloat16, tp=2, rank=1, exponents=(-2, 2))
    assert check_load_values(block, q) <= 1
