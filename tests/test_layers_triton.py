"""Mixers on the Triton backend: the delta rule and the short convolutions both on Triton kernels,
against the same layer on the PyTorch chunk path (outputs, parameter gradients, decoding).

The Triton tests run on a CUDA GPU, or on CPU tensors under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_layers_triton.py

(README's test command runs this file a second time with it set); skipped otherwise. Which path
a layer's convolutions take is checked everywhere. Shapes are tiny: the interpreter runs every
operation of a kernel in Python.
"""

from __future__ import annotations

import pytest
import torch
from conftest import check_ffn_recompute, run_in_pieces

from deltalab.analysis import gate_sensitivity
from deltalab.layers import (
    DeltaNet,
    DiagonalKDN,
    ExactKDN,
    GatedDeltaNet,
    GatedDeltaNet2,
    IsotropicKDN,
    KDNMuir,
    KimiDeltaAttention,
    Muir,
)
from deltalab.layers.delta_mixer import DeltaMixer
from deltalab.layers.short_conv import ShortConvolution, short_conv_backend
from deltalab.models import CausalLM, build_config
from deltalab.ops import short_conv
from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.testing import assert_close

pytestmark = pytest.mark.interpreter

CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))

# Every mixer with the delta-rule frontend, hence three short convolutions (Attention has none).
MIXERS = (
    DeltaNet,
    GatedDeltaNet,
    KimiDeltaAttention,
    GatedDeltaNet2,
    Muir,
    IsotropicKDN,
    DiagonalKDN,
    ExactKDN,
    KDNMuir,
)
# K = 16 and chunks of 16 keep the interpreter's tiles small; 20 tokens make two chunks, a partial
# one among them.
FRONTEND = dict(hidden_size=32, num_heads=2, head_dim=16, value_dim=8, conv_size=4, chunk_size=16)
# Both sides compute in float32 from the same inputs; the paths differ in the order of sums.
F32 = 1e-5


def build(mixer, backend):
    torch.manual_seed(0)
    return mixer(**FRONTEND, backend=backend).to(DEVICE)


def spy_short_conv(monkeypatch) -> list[str]:
    """The backend of every call the layers make to `short_conv` (the conv1d path makes none)."""
    calls: list[str] = []

    def spy(*args, backend, **kwargs):
        calls.append(backend)
        return short_conv(*args, backend=backend, **kwargs)

    monkeypatch.setattr("deltalab.layers.short_conv.short_conv", spy)
    return calls


@pytest.mark.parametrize(
    ("backend", "dtype", "expected"),
    [
        ("triton", torch.float32, "triton"),
        ("auto", torch.float32, "auto"),
        ("auto", torch.bfloat16, "auto"),
        ("auto", torch.float64, "torch"),
        ("chunk", torch.float32, "torch"),
        ("naive", torch.float64, "torch"),
    ],
)
def test_short_convolutions_take_the_kind_of_path_of_the_delta_rule(backend, dtype, expected):
    assert short_conv_backend(backend, dtype) == expected


@pytest.mark.parametrize(
    "backend",
    [
        "chunk",
        "naive",
        "auto",
        pytest.param("triton", marks=needs_triton),
    ],
)
def test_layer_runs_its_convolutions_on_triton_exactly_where_auto_or_triton_ask(
    monkeypatch, backend
):
    """Backend "auto" runs them on Triton on CUDA only (CPU tensors stay on conv1d, even under the
    interpreter); "triton" everywhere it runs; the PyTorch backends never."""
    calls = spy_short_conv(monkeypatch)
    layer = build(GatedDeltaNet2, backend)
    layer(torch.randn(2, 5, FRONTEND["hidden_size"], device=DEVICE))
    on_triton = backend == "triton" or (backend == "auto" and CUDA)
    assert calls == ([backend] * 3 if on_triton else [])


def test_shortconvolution_keeps_the_parameter_of_nn_conv1d_whatever_the_backend():
    """Checkpoints written before the convolutions could run on Triton load unchanged."""
    conv = ShortConvolution(6, 4)
    assert {name: p.shape for name, p in conv.named_parameters()} == {"weight": (6, 1, 4)}


def test_shortconvolution_refuses_an_unknown_backend_naming_it():
    with pytest.raises(ValueError, match="backend must be one of"):
        ShortConvolution(6, 4)(torch.zeros(1, 2, 6), backend="chunk")


@needs_triton
@pytest.mark.parametrize("mixer", MIXERS, ids=lambda cls: cls.__name__)
def test_triton_layer_matches_chunk_layer_with_parameter_gradients(monkeypatch, mixer):
    """The same parameters (a state dict loaded strictly) on both backends: the same outputs and
    gradients of every parameter, the convolution weights among them."""
    chunk, triton = build(mixer, "chunk"), build(mixer, "triton")
    triton.load_state_dict(chunk.state_dict(), strict=True)
    x = torch.randn(2, 20, FRONTEND["hidden_size"], device=DEVICE)
    dy = torch.randn(2, 20, FRONTEND["hidden_size"], device=DEVICE)
    calls = spy_short_conv(monkeypatch)
    results = {}
    for name, layer in (("chunk", chunk), ("triton", triton)):
        y, _ = layer(x)
        (y * dy).sum().backward()
        results[name] = (y.detach(), {n: p.grad for n, p in layer.named_parameters()})
    assert calls == ["triton"] * 3
    (y_triton, grads_triton), (y_chunk, grads_chunk) = results["triton"], results["chunk"]
    assert_close(y_triton, y_chunk, F32, "y")
    assert all(grad is not None for grad in grads_chunk.values())

    # All gradients together, as the model test does: a decay's own gradient (a sum over tokens
    # of the delta rule's dg, with cancellation) alone differs by a few 1e-6 between the paths.
    def flat(grads):
        return torch.cat([grads[name].flatten() for name in grads_chunk])

    assert_close(flat(grads_triton), flat(grads_chunk), F32, "parameter gradients")
    for conv in ("q_conv", "k_conv", "v_conv"):
        name = f"{conv}.weight"
        assert_close(grads_triton[name], grads_chunk[name], F32, f"d{name}")


@needs_triton
def test_triton_prefill_then_decoding_steps_match_one_forward(monkeypatch):
    """A prompt, then one-token steps and a short piece, each continuing from the conv caches the
    last call left: the outputs and state of one forward over the whole sequence. The steps run
    the convolution kernels with the cache."""
    layer = build(GatedDeltaNet2, "triton")
    x = torch.randn(2, 20, FRONTEND["hidden_size"], device=DEVICE)
    calls = spy_short_conv(monkeypatch)
    with torch.no_grad():
        full, full_state = layer(x)
        pieces, state = run_in_pieces(layer, x, [14, 1, 1, 2, 1, 1])
    assert calls == ["triton"] * 3 * 7
    assert_close(pieces, full, F32, "outputs in pieces")
    for name in ("memory", "conv_q", "conv_k", "conv_v"):
        assert_close(getattr(state, name), getattr(full_state, name), F32, name)


def test_gate_sensitivity_probes_run_the_convolutions_of_triton_layers_on_conv1d(generator):
    """Forward-mode AD cannot go through the convolution kernels (their autograd Function defines
    no jvp): while gate sensitivity runs a Triton model's layers on the chunk path, their short
    convolutions take the conv1d path too, and the model keeps its backend. (Without Triton a
    convolution sent to it would raise; under the interpreter its missing jvp would.)"""
    torch.manual_seed(0)
    sizes = dict(num_layers=1, hidden_size=32, head_dim=16, chunk_size=16)
    model = CausalLM(build_config("tiny", mixer="muir", backend="triton", **sizes)).eval()
    backends: list[str] = []
    for conv in model.modules():
        if isinstance(conv, ShortConvolution):
            conv.register_forward_pre_hook(
                lambda _, args, kwargs: backends.append(kwargs["backend"]), with_kwargs=True
            )
    batch = torch.randint(0, 256, (1, 8), generator=generator)
    with torch.no_grad():
        gate_sensitivity(model, batch, probes=1, loss_fn=lambda m, b: m(input_ids=b, labels=b).loss)
    assert backends and set(backends) == {"torch"}
    assert {m.backend for m in model.modules() if isinstance(m, DeltaMixer)} == {"triton"}


# The gated norm's gate, a low-rank projection's output (`DeltaMixer.output_gate`): the norm
# saves it as rows (`rebuildable_as`), whose recipe makes the gate again.
GATE = ["reshaped", "low_rank_gate"]


REBUILT = [
    ("gdn2", [*GATE, "sigmoid_gate", "sigmoid_gate", "log_decay"]),
    # beta reaches the delta rule as it is (a strength per token): no product to rebuild.
    ("kda", [*GATE, "log_decay"]),
    ("muir", [*GATE, "read_query", "sigmoid_gate", "sigmoid_gate", "log_decay"]),
    # The gain keeps g too: it rebuilds it as well, so that no one keeps it.
    ("kdn_diag", [*GATE, "log_decay", "log_decay"]),
    ("kdn_iso", [*GATE, "log_decay", "log_decay"]),
    ("deltanet", []),  # a full-rank output gate (kept), beta as it is
]
# Under checkpointed blocks the model turns rebuilding off for the whole block
# (`_recompute.without_rebuild`), which every mark and recipe reads: checked on the mixers with
# the most recipes, Muir's (every kind a gate product makes) and Diagonal KDN's (the gain's own).
CHECKPOINTED = {"muir", "kdn_diag"}


@needs_triton
@pytest.mark.parametrize(
    ("mixer", "rebuilt", "checkpoint_blocks"),
    [
        *(pytest.param(m, r, False, id=f"-{m}-rebuilt{i}") for i, (m, r) in enumerate(REBUILT)),
        *(
            pytest.param(m, r, True, id=f"checkpointed-blocks-{m}-rebuilt{i}")
            for i, (m, r) in enumerate(REBUILT)
            if m in CHECKPOINTED
        ),
    ],
)
def test_delta_rule_inputs_made_by_cheap_ops_are_rebuilt_in_the_backward_not_kept(
    monkeypatch, mixer, rebuilt, checkpoint_blocks
):
    """On the Triton kernels the delta rule's Function saves q, a, b, u, g: those a gate product,
    the read gate or the log decay made (`rebuildable`) are made again in the backward from what
    those ops keep (Diagonal KDN's g also for its gain, which saves it too), and so is the
    low-rank output gate the gated norm saves (first, its backward runs first), with the same
    loss and gradients bit for bit; under activation checkpointing of the blocks nothing is
    (the checkpoint keeps none of them)."""
    from deltalab.ops import _recompute

    made = []
    call = _recompute.Recipe.__call__

    def spy(self):
        made.append(getattr(self.fn, "func", self.fn).__name__.lstrip("_"))
        return call(self)

    monkeypatch.setattr(_recompute.Recipe, "__call__", spy)
    sizes = dict(num_layers=1, hidden_size=32, num_heads=2, head_dim=16, chunk_size=16)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results, calls = {}, {}
    for rebuild in (False, True):
        torch.manual_seed(0)  # the same weights either way
        options = {"rebuild_in_backward": rebuild}
        config = build_config("tiny", mixer=mixer, backend="triton", kernel_options=options,
                              **sizes)  # fmt: skip
        model = CausalLM(config).to(DEVICE)
        model.model.checkpoint_blocks = checkpoint_blocks  # as the trainer sets it
        made.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[rebuild] = [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        calls[rebuild] = list(made)
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)
    assert calls[False] == []
    assert calls[True] == ([] if checkpoint_blocks else rebuilt)


@needs_triton
def test_recomputing_the_ffn_on_the_triton_kernels_keeps_none_of_its_activations(monkeypatch):
    """train.recompute_ffn with the norms and SwiGLU on their Triton kernels: the FFN branch
    recomputed, none of its hidden activations kept, every gradient the same bit for bit
    (tests/test_memory.py checks the torch path, GDN-2's and the Transformer's). The
    Transformer's blocks: the FFN branch is the same in every model, and a GDN-2 model's delta
    rule would take the interpreter 50 s more here."""
    check_ffn_recompute("transformer", "triton", monkeypatch)
