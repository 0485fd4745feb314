"""Every test starts from the same random state, so the same commit gives the same result.

Tests that draw inputs with ``torch.randn`` and friends without a generator of their own would
otherwise depend on which tests ran before them (and on xdist's scheduling). The seed is derived
from the test's id, so different tests still see different data.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _fixed_random_state(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    yield


@pytest.fixture
def isolated_selection(tmp_path, monkeypatch):
    """The selector's disk cache in this test's own directory, no ``FP8REF_BACKEND``, and the
    selector's and ``fp8ref.linear``'s in-memory tables empty before and after (modules that need
    it use ``pytestmark = pytest.mark.usefixtures("isolated_selection")``)."""
    from fp8ref import api
    from fp8ref import select as sel

    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(sel.ENV_BACKEND, raising=False)
    sel.clear_cache()
    yield
    sel.clear_cache()
    api.clear_weight_cache()


@pytest.fixture
def tiny_bench_model(monkeypatch):
    """``fp8ref.bench.model`` with ``build_model`` returning a tiny Llama (hidden 64, 4 heads, the
    layers asked for) instead of a model's real size: the bench's code paths in seconds. Yields
    the module."""
    transformers = pytest.importorskip("transformers")
    from fp8ref.bench import model as bm

    def tiny(name, layers=1):
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=layers, vocab_size=96)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()

    monkeypatch.setattr(bm, "build_model", tiny)
    return bm
