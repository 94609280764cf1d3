"""Context parallelism: sequences split over gloo processes give the one-process outputs and
gradients for every mixer; the span compositions it rests on equal one run of the whole span."""

from __future__ import annotations

import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import needs_triton

from deltalab.catalog import MIXER_CLASSES
from deltalab.errors import ConfigError
from deltalab.models.mixers import mixer_class
from deltalab.ops import delta_rule, mobius_scan
from deltalab.ops._triton import INTERPRET
from deltalab.ops.context_parallel import (
    affine_span,
    context_parallel,
    span_outputs,
    start_states,
)
from deltalab.ops.mobius.parallel import apply_map, compose, span_map
from deltalab.testing import TOLERANCE, assert_close, relative_error
from deltalab.train.context import split_context
from deltalab.train.distributed import Distributed

TOL = 1e-10
BATCH, HIDDEN, HEADS, HEAD_DIM, PER_RANK = 2, 16, 2, 8, 8


def _run(q, a, b, u, g, initial_state, backend="chunk"):
    return delta_rule(
        q, a, b, u, g, initial_state=initial_state, output_final_state=True, chunk_size=16,
        backend=backend,
    )  # fmt: skip


def _random_inputs(length: int, strength: bool):
    gen = torch.Generator().manual_seed(3)
    B, H, K, V = 2, 2, 8, 6

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, b = randn(B, length, H, K), torch.nn.functional.normalize(randn(B, length, H, K), dim=-1)
    a = randn(B, length, H).sigmoid() if strength else 0.5 * randn(B, length, H, K)
    u, g = randn(B, length, H, V), -torch.rand(B, length, H, K, generator=gen).double()
    return q, a, b, u, g


def _composed(run, inputs, initial, bounds):
    """Outputs and final state of `inputs` (q, a, b, u, g) from `initial`, each span of
    `bounds` run alone from `[0, I]` (`affine_span`) and the spans composed."""
    spans = [affine_span(run, *(x[:, s:e] for x in inputs)) for s, e in bounds]
    # The initial state enters as a span of its own: no transition, offset `initial`.
    maps = torch.stack([torch.zeros_like(spans[0][2]), *(s[2] for s in spans)])
    offsets = torch.stack([initial.to(maps.dtype), *(s[3] for s in spans)])
    states = start_states(maps, offsets)
    outputs = [span_outputs(o0, read, states[i + 1]) for i, (o0, read, _, _) in enumerate(spans)]
    return torch.cat(outputs, dim=1), states[-1]


@pytest.mark.parametrize("strength", [False, True], ids=["direction", "strength"])
@pytest.mark.parametrize("backend", ["chunk", "naive"])
def test_composed_affine_spans_equal_one_run_of_the_whole_span(strength, backend):
    inputs = _random_inputs(40, strength)
    initial = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    expected = _run(*inputs, initial, backend)

    def run(*args):
        return _run(*args, backend)

    actual = _composed(run, inputs, initial, [(0, 7), (7, 24), (24, 40)])
    for x, ref in zip(actual, expected, strict=True):
        assert relative_error(x, ref) < TOL


@pytest.mark.interpreter
@needs_triton
def test_composed_affine_spans_on_the_triton_kernels_give_the_loops_outputs_and_gradients():
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    inputs = _random_inputs(40, strength=True)

    def gradients(dtype, where, compute):
        leaves = [x.detach().to(where, dtype).requires_grad_() for x in inputs]
        o, final = compute(leaves)
        weight = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape)
        ((o * weight.to(where, o.dtype)).sum() + final.sum()).backward()
        return [o, final, *(x.grad for x in leaves)]

    def triton(*args):
        return _run(*args, "triton")

    zero = torch.zeros(2, 2, 8, 6, dtype=torch.float32, device=device)
    actual = gradients(
        torch.float32, device, lambda x: _composed(triton, x, zero, [(0, 19), (19, 40)])
    )
    expected = gradients(torch.float64, "cpu", lambda x: _run(*x, None, "naive"))
    labels = ["o", "final state", "dq", "da", "db", "du", "dg"]
    for label, x, ref in zip(labels, actual, expected, strict=True):
        assert_close(x, ref, TOLERANCE[torch.float32], label)


def test_composed_mobius_spans_equal_one_scan_of_the_whole_span():
    gen = torch.Generator().manual_seed(5)
    steps = 37
    A, B, C = (torch.rand(3, 4, steps, generator=gen, dtype=torch.float64) for _ in range(3))
    D = 1 + B * C / A + torch.rand(3, 4, steps, generator=gen, dtype=torch.float64)
    x0 = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    expected = mobius_scan(A, B, C, D, x0, backend="sequential")[..., -1]
    first, second = (
        span_map(tuple(x[..., s] for x in (A, B, C, D)))  # type: ignore[arg-type]
        for s in (slice(0, 16), slice(16, None))
    )
    assert relative_error(apply_map(compose(second, first), x0), expected) < TOL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    sizes = {"hidden_size": HIDDEN, "num_heads": HEADS, "head_dim": HEAD_DIM}
    if kind == "attention":
        layer = mixer_class(kind)(**sizes, backend="torch")
    else:
        layer = mixer_class(kind)(**sizes, chunk_size=16, backend="chunk")
    layer = layer.double()
    with torch.no_grad():
        # Away from the initialization's zeros and ones, so that every gradient path is used.
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _split_errors(kind: str, group, rank: int, world: int) -> dict[str, float]:
    """The relative errors of this rank's outputs, input gradient and (summed over ranks)
    parameter gradients against the one-process run of the whole sequences."""
    layer = _layer(kind)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, PER_RANK * world, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    whole = x.clone().requires_grad_()
    y, _ = layer(whole)
    (y * weight).sum().backward()
    expected = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    piece = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    local = x[:, piece].clone().requires_grad_()
    with context_parallel(group):
        y_local, _ = layer(local)
    (y_local * weight[:, piece]).sum().backward()
    errors = {
        "output": relative_error(y_local, y[:, piece]),
        "x grad": relative_error(local.grad, whole.grad[:, piece]),
    }
    for name, p in layer.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        errors[f"{name} grad"] = relative_error(grad, expected[name])
    return errors


def _layer_ranks(rank: int, world: int, port: int, kinds: list[str], queue) -> None:
    torch.set_num_threads(1)
    try:
        init = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init)
        group = dist.new_group(list(range(world)))
        report: dict[str, object] = {}
        for kind in kinds:
            if kind == "kdn_exact":
                try:
                    with context_parallel(group):
                        _layer(kind)(torch.zeros(BATCH, PER_RANK, HIDDEN, dtype=torch.float64))
                    report[kind] = "no error"
                except ValueError as error:
                    report[kind] = str(error)
                continue
            report[kind] = _split_errors(kind, group, rank, world)
        queue.put((rank, report))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, traceback.format_exc()))


def _spawn(target, world: int, *args) -> dict[int, object]:
    # Forked: the ranks share the test process's imports (spawned ones import torch and
    # deltalab again, each, tens of seconds on two cores); each rank runs on one thread. A
    # process that has initialized CUDA cannot fork children that touch it: they are spawned.
    context = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    queue = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=target, args=(rank, world, port, *args, queue))
        for rank in range(world)
    ]
    for p in processes:
        p.start()
    reports = dict(queue.get(timeout=120) for _ in processes)
    for p in processes:
        p.join(timeout=30)
    return reports


@pytest.mark.parametrize("world", [2, 4])
def test_every_mixer_split_over_ranks_gives_the_one_process_outputs_and_gradients(world):
    kinds = list(MIXER_CLASSES)
    reports = _spawn(_layer_ranks, world, kinds)
    for rank, report in sorted(reports.items()):
        assert isinstance(report, dict), f"rank {rank} failed:\n{report}"
        assert "ExactKDN does not run under context parallelism" in str(report["kdn_exact"])
        for kind in kinds:
            if kind == "kdn_exact":
                continue
            worst = max(report[kind].items(), key=lambda item: item[1])
            assert worst[1] < TOL, f"{kind} on rank {rank}: {worst[0]} off by {worst[1]:.2e}"


def test_a_split_that_does_not_divide_the_ranks_or_leaves_no_carry_is_refused_by_name():
    ranks = Distributed(rank=0, world_size=3, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^train\.context_parallel \(2\) must divide .*got 3"):
        split_context(ranks, 2, seq_len=64, conv_size=4)
    ranks = Distributed(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"leaves 2 tokens per rank, fewer than .* = 3"):
        split_context(ranks, 2, seq_len=4, conv_size=4)
