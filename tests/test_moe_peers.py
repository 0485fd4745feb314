"""The fused-MoE peers' harness (fp8ref/peers/moe_triton.py): the block alignment written from the
projects' ``moe_align_block_size`` docstring, and (where SGLang or vLLM imports: /work/peersenv,
``TRITON_INTERPRET=1``) one sweep item per project through the real kernels."""

import os

import pytest
import torch

from fp8ref.peers.moe_triton import align_block_size


def test_alignment_matches_the_projects_docstring_example():
    # moe_align_block_size's docstring: topk_ids [[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], block 4,
    # ids 1..4 of 5 experts -> [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_ids, expert_ids, n = align_block_size(ids, 4, 5)
    assert sorted_ids.tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids.tolist() == [1, 2, 3, 4] and n.tolist() == [16]


def test_alignment_puts_other_ranks_pairs_in_a_bucket_of_expert_minus_one():
    ids = torch.tensor([[0, -1], [-1, 1]], dtype=torch.int32)
    sorted_ids, expert_ids, n = align_block_size(ids, 2, 2)
    assert sorted_ids.tolist() == [1, 2, 0, 4, 3, 4] and expert_ids.tolist() == [-1, 0, 1] and n.tolist() == [6]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels run under TRITON_INTERPRET=1")
@pytest.mark.parametrize("project", ["sglang", "vllm"])
def test_a_block_item_through_the_real_kernels(project):
    pytest.importorskip(project)
    from fp8ref.check.moe import MoeSpec, build_problem, check_moe_problem
    from fp8ref.conformance.moe import MOE_SCHEMES
    from fp8ref.peers.moe_triton import SGLangFusedMoe, VLLMFusedMoe

    peer = SGLangFusedMoe() if project == "sglang" else VLLMFusedMoe()
    if peer.available():
        pytest.skip(peer.available())
    spec = MoeSpec(5, 128, 128, 4, 2, routing="empty", spread=4.0, outlier_rows=True, seed=8)
    assert check_moe_problem(peer, build_problem(spec, MOE_SCHEMES["block128"])) <= 1
