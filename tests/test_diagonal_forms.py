"""benchmarks/diagonal_forms.py: which diagonal sub-blocks the Triton stage 1 would walk."""

from __future__ import annotations

import torch

from benchmarks import diagonal_forms
from deltalab.ops.delta_rule.triton.intra import DIAGONAL_FACTOR_BOUND, SUB_BLOCK


def test_depth_is_the_deepest_channel_of_each_full_sub_block():
    g = torch.zeros(1, 2 * SUB_BLOCK + 3, 1, 4)  # two full sub-blocks and a partial one
    g[0, :SUB_BLOCK, 0, 2] = -1.0
    g[0, SUB_BLOCK:, 0, 1] = -3.0
    depth = diagonal_forms.sub_block_depths(g)
    assert depth.shape == (1, 2, 1)
    assert depth.flatten().tolist() == [SUB_BLOCK * 1.0, SUB_BLOCK * 3.0]
    # One log decay per head [B, T, H] is the same as that decay on every channel.
    assert diagonal_forms.sub_block_depths(g[..., 1]).flatten().tolist() == [0.0, 48.0]


def test_a_model_walks_only_where_its_decays_pass_the_bound():
    from deltalab.models import CausalLM, build_config

    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer="gdn2", num_layers=2))
    ids = torch.randint(0, 256, (1, 4 * SUB_BLOCK))
    mild = diagonal_forms.measure(model, ids)
    assert len(mild) == 2 and all(depth < DIAGONAL_FACTOR_BOUND for _, depth in mild.values())
    assert all(walked == 0.0 for walked, _ in mild.values())
    # At a bound of 0 every sub-block counts as walked.
    assert all(walked == 1.0 for walked, _ in diagonal_forms.measure(model, ids, 0.0).values())
    with torch.no_grad():  # decay rates e^6 ~ 400 times larger: every sub-block goes deep
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log += 6.0
    strong = diagonal_forms.measure(model, ids)
    assert all(walked == 1.0 for walked, _ in strong.values())
