"""Shared fixtures: random inputs drawn from a local generator, never the global RNG."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltalab.ops._triton import HAS_TRITON, INTERPRET

# Test shapes are tiny: one thread is faster than two, and a busy second core (CI neighbours,
# a background job) cannot stall every parallel region at a thread barrier.
torch.set_num_threads(1)

# Triton kernels run here: compiled on a CUDA GPU, or on CPU tensors under TRITON_INTERPRET=1.
TRITON_RUNS = HAS_TRITON and (INTERPRET or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(
    not TRITON_RUNS, reason="needs Triton on a CUDA GPU, or TRITON_INTERPRET=1 on CPU"
)


def random_delta_inputs(
    generator: torch.Generator,
    batch: int,
    length: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    *,
    channel_decay: bool,
    dtype: torch.dtype = torch.float64,
    min_log_decay: float = -1.0,
    strengths: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(q, a, b, u, g) shaped like a gated delta rule: unit keys, write strength in (0, 1).

    The recurrence is then contractive, as in every mixer of the project, so float32 and float64
    runs are comparable over long sequences. a is the write direction beta * k, or with
    `strengths` beta itself [B, T, H] (the primitive's per-token form of a).
    """

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    def uniform(*shape):
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    k = torch.nn.functional.normalize(draw(batch, length, heads, key_dim), dim=-1)
    beta = uniform(batch, length, heads, 1)
    q = draw(batch, length, heads, key_dim)
    u = draw(batch, length, heads, value_dim)
    g_shape = (batch, length, heads, key_dim) if channel_decay else (batch, length, heads)
    g = uniform(*g_shape) * min_log_decay
    a = beta[..., 0] if strengths else beta * k
    return tuple(x.to(dtype) for x in (q, a, k, u, g))


def run_in_pieces(mixer, x: torch.Tensor, pieces: list[int], state=None):
    """Feeds x `[B, T, D]` to a mixer in consecutive pieces of the given lengths, threading the
    state (from `state`; None: a new sequence) -> (outputs `[B, T, D]`, last state)."""
    assert sum(pieces) == x.shape[1]
    outputs, start = [], 0
    for n in pieces:
        y, state = mixer(x[:, start : start + n], state)
        outputs.append(y)
        start += n
    return torch.cat(outputs, dim=1), state


def assert_same_recurrent_state(buffers, expected, rtol: float = 1e-4, atol: float = 1e-5):
    """Every tensor field of a recurrent state dataclass (memory, conv caches, KDN filter
    state; not the gates a forward records) of `buffers` close to `expected`'s."""
    import dataclasses

    for f in dataclasses.fields(expected):
        value = getattr(expected, f.name)
        if f.name != "gates" and isinstance(value, torch.Tensor):
            torch.testing.assert_close(getattr(buffers, f.name), value, rtol=rtol, atol=atol)


def built_and_default_adamw_steps(
    model, generator: torch.Generator, steps: int = 3, fused: bool | None = None
):
    """`build_optimizer`'s AdamW on `model` (`fused` passed on) and, on a copy, the same with
    torch's default step (fused off), stepped with the same drawn gradients: (the built
    optimizer, [(name, its parameter, the copy's)]). Gradients are drawn, not taken from a
    backward: the GPU's is not bit-reproducible, and Adam's first steps turn the sign flip of a
    near-zero gradient into a whole learning-rate step."""
    import copy

    from deltalab.train import optim
    from deltalab.train.config import OptimSection

    # The copy's groups by the original's names: deepcopy drops the parameters' no-decay marks.
    twin, exempt = copy.deepcopy(model), optim.no_decay_names(model)
    settings = OptimSection(lr=1e-3)
    built = optim.build_optimizer(model, settings, fused=fused)
    default = optim.build_optimizer(twin, settings, exempt, fused=False)
    pairs = list(zip(model.parameters(), twin.parameters(), strict=True))
    for _ in range(steps):
        for p, q in pairs:
            grad = torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device)
            p.grad, q.grad = grad, grad.clone()
        built.step()
        default.step()
    names = [name for name, _ in model.named_parameters()]
    return built, [(name, p, q) for name, (p, q) in zip(names, pairs, strict=True)]


@pytest.fixture
def generator(request) -> torch.Generator:
    """A generator seeded from the test's name: fresh inputs per test, reproducible per test."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.name)) % (2**31)
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled tensors: an element a kernel never writes
    turns the comparison into a failure instead of passing on leftover memory."""
    empty, empty_like = torch.empty, torch.empty_like

    # Filled before requires_grad is set: an in-place fill of a leaf that requires grad is an
    # error (torch.utils.checkpoint makes such a leaf with torch.empty on torch 2.11).
    def poisoned(x: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        if x.dtype.is_floating_point:
            x.fill_(float("nan"))
        return x.requires_grad_(requires_grad)

    def nan_empty(*args, requires_grad=False, **kwargs):
        return poisoned(empty(*args, **kwargs), requires_grad)

    def nan_empty_like(*args, requires_grad=False, **kwargs):
        return poisoned(empty_like(*args, **kwargs), requires_grad)

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)

    def nan_new_empty(self, *size, **kwargs):
        return nan_empty(*size, **{"dtype": self.dtype, "device": self.device, **kwargs})

    monkeypatch.setattr(torch.Tensor, "new_empty", nan_new_empty)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """`make_corpus`'s documents, made once per test module: a training run's data."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def make_corpus(folder: Path) -> str:
    """A directory of 60 small documents: repetitive enough to learn in a few steps."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["def", "return", "self", "value", "for", "in", "range", "if", "else", "print"]
    for i in range(60):
        lines = [f"{words[i % 10]} item_{j} = {words[(i + j) % 10]}({j})" for j in range(12)]
        (folder / f"doc_{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return str(folder)


def with_formula_norms(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every RMS norm on its "naive" backend: the formula under autograd, whose
    gradients round as recorded references' do (the torch path's hand-written adjoints round
    otherwise; its outputs are the formula's bit for bit)."""
    from deltalab.layers.norms import GatedRMSNorm, RMSNorm

    for module in model.modules():
        if isinstance(module, (RMSNorm, GatedRMSNorm)):
            module.backend = "naive"
    return model


def check_ffn_recompute(mixer: str, backend: str, monkeypatch) -> None:
    """A small model of `mixer` on `backend`, trained one step with and without
    `DeltaLabModel.recompute_ffn` (train.recompute_ffn): with it each block's FFN branch is
    recomputed and no tensor of the FFN's hidden width is kept for backward (without it, its
    activations and its weights' autocast copies are), fewer bytes are kept in all, and every
    parameter's gradient is the same bit for bit; in eval mode (gradients on) nothing is
    recomputed. bf16 autocast on the torch path; the Triton kernels compute in float32 (under
    the interpreter on CPU, whose bf16 is not bf16's)."""
    import deltalab.models.lm as lm
    from deltalab.models import CausalLM, DeltaLabConfig
    from deltalab.ops._recompute import recomputed

    config = DeltaLabConfig(
        mixer=mixer, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, vocab_size=50,
        chunk_size=16, backend=backend, ffn_width=48,
    )  # fmt: skip
    device = "cuda" if torch.cuda.is_available() and backend == "triton" else "cpu"
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    branches = []
    monkeypatch.setattr(
        lm, "recomputed", lambda fn, *args: branches.append(fn) or recomputed(fn, *args)
    )
    autocast = backend != "triton" or device == "cuda"

    def run(recompute_ffn):
        torch.manual_seed(0)
        model = CausalLM(config).to(device)
        model.model.recompute_ffn = recompute_ffn
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = (t.shape, t.untyped_storage().nbytes())
            return t

        with (
            torch.autocast(device, dtype=torch.bfloat16, enabled=autocast),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            loss = model(ids, labels=ids).loss
        loss.backward()
        hidden = [shape for shape, _ in kept.values() if len(shape) >= 2 and shape[-1] in (48, 96)]
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        made = len(branches)
        model.eval()(ids).logits.sum().backward()  # eval mode, gradients on
        assert len(branches) == made, "recomputed outside training"
        return sum(n for _, n in kept.values()), hidden, grads, made

    kept, hidden, grads, made = run(True)
    assert made == config.num_layers
    branches.clear()
    kept_plain, hidden_plain, grads_plain, made_plain = run(False)
    assert made_plain == 0
    assert hidden == [] and hidden_plain
    assert kept < kept_plain
    assert grads.keys() == grads_plain.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, grads_plain[name]), name


@pytest.fixture
def norm_calls(monkeypatch) -> list:
    """The `RMSNorm` modules called from here on, in order: a spy on the class's forward (a
    hook of a module's own would make the decoding step run it as a module, `fusable`)."""
    from deltalab.layers.norms import RMSNorm

    calls = []
    forward = RMSNorm.forward

    def counted(module, x):
        calls.append(module)
        return forward(module, x)

    monkeypatch.setattr(RMSNorm, "forward", counted)
    return calls
