"""The test suite's own fixtures (conftest.py) do what the kernel tests rely on."""

import torch


def test_poisoned_empty_fills_with_nan_and_still_makes_leaves_that_require_grad(poisoned_empty):
    """Unwritten elements read as NaN, and a leaf that requires grad (torch.utils.checkpoint
    makes one with torch.empty) is created without an in-place error."""
    assert torch.isnan(torch.empty(3)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(2))).all()
    assert torch.isnan(torch.zeros(1).new_empty(4)).all()
    leaf = torch.empty((0,), requires_grad=True)
    assert leaf.requires_grad and leaf.is_leaf
    assert torch.empty(2, dtype=torch.int64).dtype == torch.int64
