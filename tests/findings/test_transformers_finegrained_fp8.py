"""transformers 4.57's FineGrainedFP8 activation quantizer (``integrations/finegrained_fp8.py``:
``act_quant`` / ``act_quant_kernel``, DeepSeek-V3's Triton kernel, 1 x 128 groups): standalone
reproduction, no fp8ref. It states the correct behaviour and fails today (strict xfail).

transformers 5.x no longer ships the kernel (it fetches ``kernels-community/finegrained-fp8`` from
the Hub at run time, where the same line was fixed by huggingface/kernels-community PR #680), so
this runs only where transformers 4.57.x is installed (it is skipped in fp8ref's own CI, which
holds transformers 5.x for the audits). Without a GPU it needs ``TRITON_INTERPRET=1``.

docs/findings.md explains it and why it matters for a served model.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("4.57."):
    pytest.skip(f"needs transformers 4.57.x (found {transformers.__version__}): 5.x fetches the kernel from the Hub",
                allow_module_level=True)
ff8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


@pytest.mark.xfail(strict=True, reason="huggingface/kernels-community#681 (fixed there by PR #680; 4.57's copy is not)")
def test_all_zero_group_gets_a_positive_scale():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[0, :128] = 1.0  # one non-zero group; the other three groups are zero (e.g. padding tokens)
    _, s = ff8.act_quant(x, 128)
    # s = max|x| / 448 with no floor: 0 for a zero group, so x / s = 0 / 0 = NaN codes on a GPU
    assert bool((s > 0).all()), f"group scales {s.tolist()}: a zero group's scale is 0, its codes 0/0 = NaN"
