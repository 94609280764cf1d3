"""Bad inputs to delta_rule / delta_rule_step raise errors that name the argument."""

from __future__ import annotations

import pytest
import torch

from deltalab.ops import delta_rule, delta_rule_step


def good(batch=1, length=20, heads=2, key_dim=8, value_dim=4):
    q = torch.randn(batch, length, heads, key_dim)
    k = torch.nn.functional.normalize(torch.randn(batch, length, heads, key_dim), dim=-1)
    return dict(
        q=q,
        a=0.5 * k,
        b=k,
        u=torch.randn(batch, length, heads, value_dim),
        g=-torch.rand(batch, length, heads, key_dim),
    )


def call(**changes):
    kwargs = good()
    options = {k: changes.pop(k) for k in list(changes) if k not in kwargs}
    kwargs.update(changes)
    return delta_rule(kwargs["q"], kwargs["a"], kwargs["b"], kwargs["u"], kwargs["g"], **options)


@pytest.mark.parametrize(
    ("changes", "error", "pattern"),
    [
        (
            dict(a=torch.randn(1, 20, 2, 7)),
            ValueError,
            r"a must have shape .*\(1, 20, 2, 8\).*got \(1, 20, 2, 7\)",
        ),
        (
            dict(a=torch.rand(1, 20, 3)),
            ValueError,
            r"a must have shape \[B, T, H\] = \(1, 20, 2\) \(a strength per token\)",
        ),
        (dict(a=torch.rand(1, 20)), ValueError, r"a must have rank 3 or 4"),
        (dict(b=torch.randn(1, 21, 2, 8)), ValueError, r"b must have shape"),
        (dict(u=torch.randn(1, 20, 3, 4)), ValueError, r"u must have shape .*\(1, 20, 2, 4\)"),
        (dict(u=torch.randn(2, 20, 2, 4)), ValueError, r"u must have shape"),
        (dict(g=-torch.rand(1, 20, 2, 4)), ValueError, r"g must have shape"),
        (dict(g=-torch.rand(1, 20)), ValueError, r"g must have rank 3 or 4"),
        (dict(q=torch.randn(20, 2, 8)), ValueError, r"q must have rank 4"),
        (
            dict(g=torch.rand(1, 20, 2, 8)),
            ValueError,
            r"g must be <= 0 \(a log decay\), got a maximum",
        ),
        (
            dict(g=torch.full((1, 20, 2, 8), float("nan"))),
            ValueError,
            r"g must be <= 0 \(a log decay\), got NaN",
        ),
        (
            dict(q=torch.ones(1, 20, 2, 8, dtype=torch.int64)),
            TypeError,
            r"q must be a floating-point tensor",
        ),
        (dict(u=[[1.0]]), TypeError, r"u must be a torch.Tensor, got list"),
        (dict(chunk_size=8), ValueError, r"chunk_size must be in \[16, 256\], got 8"),
        (dict(chunk_size=512), ValueError, r"chunk_size must be in \[16, 256\], got 512"),
        (dict(chunk_size=64.0), TypeError, r"chunk_size must be an int"),
        (dict(backend="cuda"), ValueError, r"backend must be one of .*got 'cuda'"),
        (dict(scale=-1.0), ValueError, r"scale must be a finite positive number"),
        (
            dict(initial_state=torch.zeros(1, 2, 8, 5)),
            ValueError,
            r"initial_state must have shape .*\(1, 2, 8, 4\)",
        ),
        (
            dict(initial_state=torch.zeros(1, 2, 8, 4, dtype=torch.int32)),
            TypeError,
            r"initial_state must be a floating",
        ),
        (dict(output_final_state=1), TypeError, r"output_final_state must be a bool"),
        (
            dict(cu_seqlens=torch.tensor([0, 5, 20.0])),
            TypeError,
            r"cu_seqlens must be an integer tensor",
        ),
        (
            dict(cu_seqlens=torch.tensor([0, 12, 5, 20])),
            ValueError,
            r"cu_seqlens must be strictly increasing",
        ),
        (
            dict(cu_seqlens=torch.tensor([0, 5, 5, 20])),
            ValueError,
            r"cu_seqlens must be strictly increasing",
        ),
        (
            dict(cu_seqlens=torch.tensor([0, 5, 19])),
            ValueError,
            r"cu_seqlens must end at T = 20, got 19",
        ),
        (dict(cu_seqlens=torch.tensor([1, 5, 20])), ValueError, r"cu_seqlens must start at 0"),
        (dict(cu_seqlens=torch.tensor([[0, 20]])), ValueError, r"cu_seqlens must be a 1-D tensor"),
        (dict(cu_seqlens=[0, 10, 20]), TypeError, r"cu_seqlens must be a torch.Tensor, got list"),
        (dict(initial_state=0.0), TypeError, r"initial_state must be a torch.Tensor, got float"),
        (
            dict(cu_seqlens=torch.tensor([0, 5, 20]), initial_state=torch.zeros(1, 2, 8, 4)),
            ValueError,
            r"initial_state must have shape .*\(2, 2, 8, 4\)",
        ),
    ],
)
def test_bad_input_raises_naming_the_argument(changes, error, pattern):
    with pytest.raises(error, match=pattern):
        call(**changes)


def test_cu_seqlens_needs_batch_of_one():
    kwargs = good(batch=2)
    with pytest.raises(ValueError, match=r"cu_seqlens .* needs B == 1, got B = 2"):
        delta_rule(*kwargs.values(), cu_seqlens=torch.tensor([0, 5, 20]))


@pytest.mark.parametrize("per_channel_decay", [True, False])
def test_empty_key_dimension_is_refused_naming_q(per_channel_decay):
    kwargs = good(key_dim=0)
    if not per_channel_decay:
        kwargs["g"] = kwargs["g"].sum(-1)
    with pytest.raises(ValueError, match=r"q must have K >= 1 .*\(1, 20, 2, 0\)"):
        delta_rule(*kwargs.values())
    step = {name: x[:, 0] for name, x in kwargs.items()}
    with pytest.raises(ValueError, match=r"q must have K >= 1 .*\(1, 2, 0\)"):
        delta_rule_step(*step.values(), torch.zeros(1, 2, 0, 4))


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_empty_value_dimension_is_refused_naming_u(backend):
    kwargs = good(value_dim=0)
    with pytest.raises(ValueError, match=r"u must have V >= 1 .*\(1, 20, 2, 0\)"):
        delta_rule(*kwargs.values(), backend=backend)
    step = {name: x[:, 0] for name, x in kwargs.items()}
    with pytest.raises(ValueError, match=r"u must have V >= 1 .*\(1, 2, 0\)"):
        delta_rule_step(*step.values(), torch.zeros(1, 2, 8, 0))


def test_empty_sequence_is_refused():
    with pytest.raises(ValueError, match=r"q must hold at least one token \(T >= 1\), got T = 0"):
        delta_rule(*good(length=0).values())


def test_tensors_on_different_devices_are_refused():
    kwargs = good()
    kwargs["u"] = kwargs["u"].to("meta")
    with pytest.raises(ValueError, match=r"u is on meta but q is on cpu"):
        delta_rule(*kwargs.values())


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (dict(state=torch.zeros(2, 2, 8, 4)), r"state must have shape .*\(1, 2, 8, 4\)"),
        (dict(a=torch.randn(1, 2, 9)), r"a must have shape"),
        (
            dict(a=torch.rand(1, 3)),
            r"a must have shape \[B, H\] = \(1, 2\) \(a strength per token\)",
        ),
        (dict(g=torch.rand(1, 2)), r"g must be <= 0"),
        (dict(q=torch.randn(1, 1, 2, 8)), r"q must have rank 3"),
    ],
)
def test_step_bad_input_raises_naming_the_argument(changes, pattern):
    k = torch.nn.functional.normalize(torch.randn(1, 2, 8), dim=-1)
    kwargs = dict(q=torch.randn(1, 2, 8), a=k, b=k, u=torch.randn(1, 2, 4), g=-torch.rand(1, 2))
    kwargs["state"] = torch.zeros(1, 2, 8, 4)
    kwargs.update(changes)
    with pytest.raises(ValueError, match=pattern):
        delta_rule_step(**kwargs)
