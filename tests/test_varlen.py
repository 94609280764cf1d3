"""Packed sequences: the backends take `cu_seqlens` as a tensor on the inputs' device, the padded
batch is built from it by gathers and scatters, and bad offsets are refused naming `cu_seqlens`."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
from conftest import needs_triton, random_delta_inputs

from deltalab.ops import _checks, delta_rule, kdn_diag, kdn_iso
from deltalab.ops._varlen import max_seqlen, pad_packed, unpad_packed
from deltalab.ops.parametrize import DeltaRuleInputs
from deltalab.testing import TOLERANCE, assert_close

F64 = TOLERANCE[torch.float64]
# One sequence of one token, and sequences longer than the chunk size (16) used below.
LENGTHS = [1, 37, 5, 20]
# sys.modules' entry: `deltalab.ops.delta_rule` as an attribute is the function.
DELTA_RULE = importlib.import_module("deltalab.ops.delta_rule")
KDN_MIXERS = importlib.import_module("deltalab.ops.kdn.mixers")


def _offsets(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_pad_and_unpad_match_per_sequence_slices(generator, dtype):
    offsets = _offsets(LENGTHS)
    x = torch.randn(1, offsets[-1], 3, 2, generator=generator, dtype=torch.float64)
    cu = torch.tensor(offsets, dtype=dtype)
    assert max_seqlen(cu, offsets[-1]) == max(LENGTHS)
    # Longer than needed (the bound a CUDA graph capture pads to) only adds zeros.
    for max_len in (max(LENGTHS), offsets[-1] - len(LENGTHS) + 1):
        padded = pad_packed(x, cu, max_len)
        assert padded.shape == (len(LENGTHS), max_len, 3, 2)
        for i, (start, end) in enumerate(itertools.pairwise(offsets)):
            assert torch.equal(padded[i, : end - start], x[0, start:end])
            assert not padded[i, end - start :].any()
        assert torch.equal(unpad_packed(padded, cu, offsets[-1]), x)


def test_pad_and_unpad_pass_gradients_to_real_tokens_only(generator):
    offsets = _offsets(LENGTHS)
    x = torch.randn(1, offsets[-1], 2, generator=generator, dtype=torch.float64)
    cu = torch.tensor(offsets)
    x.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda t: unpad_packed(pad_packed(t, cu, 40), cu, offsets[-1]), (x,)
    )
    padded = pad_packed(x, cu, max(LENGTHS))
    weights = torch.randn(padded.shape, generator=generator, dtype=torch.float64)
    (grad,) = torch.autograd.grad((padded * weights).sum(), x)
    assert torch.equal(grad, unpad_packed(weights, cu, offsets[-1]))


def _spy(monkeypatch, module, name, position, seen):
    """Wraps module.name, recording the positional argument at `position` (cu_seqlens)."""
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(args[position])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


BACKEND_PARAMS = [
    "naive",
    "chunk",
    pytest.param("triton", marks=[needs_triton, pytest.mark.interpreter]),
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_delta_rule_backends_receive_cu_seqlens_as_a_tensor(generator, monkeypatch, backend):
    offsets = _offsets(LENGTHS)
    dtype = torch.float32 if backend == "triton" else torch.float64
    inputs = random_delta_inputs(
        generator, 1, offsets[-1], 2, 4, 3, channel_decay=True, dtype=dtype
    )
    seen = []
    if backend == "triton":
        module = importlib.import_module("deltalab.ops.delta_rule.triton.chunk")
        _spy(monkeypatch, module, "delta_rule_triton", 6, seen)
    else:
        # The PyTorch backends take (inputs, initial_state, cu_seqlens, ...).
        _spy(monkeypatch, DELTA_RULE, f"delta_rule_{backend}", 2, seen)
    cu = torch.tensor(offsets, dtype=torch.int32)
    delta_rule(*inputs, cu_seqlens=cu, chunk_size=16, backend=backend)
    (received,) = seen
    assert isinstance(received, torch.Tensor)
    assert received.dtype == torch.int64 and received.device == inputs[0].device
    assert received.tolist() == offsets


@pytest.mark.parametrize("mixer", [kdn_iso, kdn_diag], ids=["iso", "diag"])
def test_kdn_variance_scan_and_memory_receive_cu_seqlens_as_a_tensor(generator, monkeypatch, mixer):
    offsets = _offsets(LENGTHS)
    T, H, K = offsets[-1], 2, 3

    def rand(*shape):
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    diagonal = mixer is kdn_diag
    args = dict(
        q=torch.randn(1, T, H, K, generator=generator, dtype=torch.float64),
        k=torch.randn(1, T, H, K, generator=generator, dtype=torch.float64),
        v=torch.randn(1, T, H, 4, generator=generator, dtype=torch.float64),
        g=-rand(1, T, H, K),
        q_noise=0.2 * (rand(1, T, H, K) if diagonal else rand(1, T, H)),
        r=0.1 + rand(1, T, H),
        p0=0.5 + (rand(H, K) if diagonal else rand(H)),
    )
    scans, memories = [], []
    _spy(monkeypatch, KDN_MIXERS, "_packed_gains", 5, scans)
    _spy(monkeypatch, DELTA_RULE, "delta_rule_chunk", 2, memories)
    mixer(**args, cu_seqlens=torch.tensor(offsets), backend="chunk")
    for received in (*scans, *memories):
        assert isinstance(received, torch.Tensor) and received.dtype == torch.int64
        assert received.tolist() == offsets
    assert len(scans) == len(memories) == 1


def test_chunk_backend_reads_no_offsets_list(generator, monkeypatch):
    """The chunked backend pads by gathers on the device: no `.tolist()` of the offsets."""
    offsets = _offsets(LENGTHS)
    q, a, b, u, g = random_delta_inputs(generator, 1, offsets[-1], 2, 4, 3, channel_decay=False)
    state = torch.zeros(len(LENGTHS), 2, 4, 3, dtype=torch.float64)
    cu = torch.tensor(offsets)
    inputs = DeltaRuleInputs(q, a, b, u, g)
    expected = DELTA_RULE.delta_rule_naive(inputs, state, cu)

    def refuse(self):
        raise AssertionError("the chunk backend read a tensor back as a list")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    o, final = DELTA_RULE.delta_rule_chunk(inputs, state, cu, 16)
    assert_close(o, expected[0], F64, "output")
    assert_close(final, expected[1], F64, "final state")


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "capture_bound"])
def test_padded_path_matches_the_per_sequence_loop(
    generator, monkeypatch, channel_decay, capturing
):
    """chunk (padded batch from the tensor) against naive (each sequence sliced out by Python
    offsets), outputs, final states and gradients; `capture_bound` pads to T - N + 1, what
    `max_seqlen` gives while a CUDA graph is captured (faked here: no value is read back)."""
    offsets = _offsets(LENGTHS)
    inputs = random_delta_inputs(generator, 1, offsets[-1], 2, 8, 4, channel_decay=channel_decay)
    state = torch.randn(len(LENGTHS), 2, 8, 4, generator=generator, dtype=torch.float64)

    def run(backend):
        leaves = [x.clone().requires_grad_() for x in (*inputs, state)]
        o, final = delta_rule(
            *leaves[:5],
            initial_state=leaves[5],
            output_final_state=True,
            cu_seqlens=torch.tensor(offsets, dtype=torch.int32),
            chunk_size=16,
            backend=backend,
        )
        (o.square().sum() + final.square().sum()).backward()
        return [o, final, *(x.grad for x in leaves)]

    reference = run("naive")
    if capturing:
        monkeypatch.setattr(_checks, "capturing", lambda x: True)
        assert max_seqlen(torch.tensor(offsets), offsets[-1]) == offsets[-1] - len(LENGTHS) + 1
    labels = ["o", "final state", "dq", "da", "db", "du", "dg", "d initial state"]
    for label, x, ref in zip(labels, run("chunk"), reference, strict=True):
        assert_close(x, ref, F64, label)


T = 20
BAD_OFFSETS = [
    (torch.tensor([0, 5, 20.0]), TypeError, r"cu_seqlens must be an integer tensor"),
    (torch.tensor([[0, 20]]), ValueError, r"cu_seqlens must be a 1-D tensor"),
    (torch.tensor([0]), ValueError, r"cu_seqlens must be a 1-D tensor \[N\+1\] with N >= 1"),
    (torch.tensor([1, 5, 20]), ValueError, r"cu_seqlens must start at 0, got 1$"),
    (torch.tensor([0, 5, 19]), ValueError, r"cu_seqlens must end at T = 20, got 19$"),
    (
        torch.tensor([0, 12, 5, 20], dtype=torch.int32),
        ValueError,
        r"cu_seqlens must be strictly increasing, got 12 then 5 at positions 1, 2$",
    ),
    (
        torch.tensor([0, 5, 5, 20]),
        ValueError,
        r"cu_seqlens must be strictly increasing, got 5 then 5 at positions 1, 2$",
    ),
    # Unsigned offsets are compared as int64: 5 - 15 must not wrap around to 246.
    (
        torch.tensor([0, 15, 5, 20], dtype=torch.uint8),
        ValueError,
        r"cu_seqlens must be strictly increasing, got 15 then 5 at positions 1, 2$",
    ),
    (torch.tensor([0, 5, 20], device="meta"), ValueError, r"cu_seqlens is on meta"),
]


def _call(name: str, cu_seqlens, batch: int = 1):
    gen = torch.Generator().manual_seed(3)
    q, a, b, u, g = random_delta_inputs(gen, batch, T, 2, 4, 3, channel_decay=True)
    if name == "delta_rule":
        return delta_rule(q, a, b, u, g, cu_seqlens=cu_seqlens)
    shape = (batch, T, 2)
    noise = torch.full(shape + ((4,) if name == "kdn_diag" else ()), 0.1, dtype=torch.float64)
    mixer = kdn_diag if name == "kdn_diag" else kdn_iso
    return mixer(
        q,
        b,
        u,
        g,
        noise,
        torch.ones(shape, dtype=torch.float64),
        torch.ones(2, dtype=torch.float64),
        cu_seqlens=cu_seqlens,
    )


@pytest.mark.parametrize("name", ["delta_rule", "kdn_iso", "kdn_diag"])
@pytest.mark.parametrize(("cu_seqlens", "error", "match"), BAD_OFFSETS)
def test_bad_offsets_are_refused_naming_cu_seqlens(name, cu_seqlens, error, match):
    with pytest.raises(error, match=match) as caught:
        _call(name, cu_seqlens)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["delta_rule", "kdn_iso", "kdn_diag"])
def test_offsets_need_a_batch_of_one(name):
    with pytest.raises(ValueError, match=r"cu_seqlens .* needs B == 1, got B = 2$"):
        _call(name, torch.tensor([0, 5, 20]), batch=2)


@pytest.mark.parametrize("name", ["kdn_iso", "kdn_diag"])
def test_kdn_reads_the_offsets_back_once_per_call(name, monkeypatch):
    """A KDN op checks cu_seqlens and hands them to delta_rule: one host read-back, not two."""
    checked = []
    values_checkable = _checks.values_checkable

    def counting(x):
        if x.dtype == torch.int64:  # the offsets (the other value checks see float inputs)
            checked.append(x)
        return values_checkable(x)

    monkeypatch.setattr(_checks, "values_checkable", counting)
    _call(name, torch.tensor([0, 5, 20]))
    assert len(checked) == 1


def test_offsets_written_in_place_after_a_check_are_checked_again():
    cu = torch.tensor([0, 5, 20])
    assert _checks.check_cu_seqlens(cu, 1, 20, cu.device) is cu
    cu[1] = 25
    with pytest.raises(ValueError, match="strictly increasing, got 25 then 20"):
        _checks.check_cu_seqlens(cu, 1, 20, cu.device)
    with pytest.raises(ValueError, match="must end at T = 30, got 20"):
        _checks.check_cu_seqlens(torch.tensor([0, 5, 20]), 1, 30, cu.device)
