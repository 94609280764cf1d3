"""What one block of a preset saves for backward, per token, on CPU (no GPU needed).

    python -m benchmarks memory --preset 340M --mixers gdn2 muir transformer

Builds `build_config(preset, mixer=..., num_layers=2)` on CPU with float32 weights, runs the LM
loss forward under `torch.autocast("cpu", dtype=torch.bfloat16)` (training's bf16 autocast on
CUDA) at two lengths, and records every tensor saved for backward with
`torch.autograd.graph.saved_tensors_hooks`: shape, dtype, the op that made it (its grad_fn), the
backward node that saved it, and the lines of deltalab that saved it. Only saves the loss's
graph reaches count. Bytes count each storage once (by `untyped_storage().data_ptr()`; every
saved tensor is held, so no address is reused), charged to the first block that saves it.
Bytes per token are the difference between the two lengths over the difference in tokens, so
weights and their bf16 autocast copies drop out. The last block is reported (the first one's
input is the embedding's output). "same values as #n": a tensor holding the values of an
earlier one, to bf16 rounding, in any dtype or layout (norm weights and zero-initialized
projections are randomized first, so that distinct tensors do not coincide).

The delta-rule primitive is charged as the CUDA Triton kernel (`_DeltaRuleTriton`) saves, not
as the CPU "chunk" backend: nothing saved inside `delta_rule` is recorded; instead its inputs
q, a, b, u, g are charged (once per storage, so shared with the layer's saves; a non-contiguous
input as the copy its `.contiguous()` makes; an input the backward rebuilds, `rebuildable`, as
the tensors its recipe holds), plus the chunk-start states `[B, H, n, K, V]` and
the residuals `[B, H, n, C, V]`, float32, with `--keep-states`; by default the chunk-start
states of every `checkpoint_every`-th chunk instead, as the kernel keeps with
`KernelOptions.recompute_states`, its default). Softmax attention is charged
as a flash kernel saves: its q, k, v, output and the float32 log-sum-exp `[B, H, T]`.

Not seen: the backward's transient memory (gradients in flight, the kernels' workspaces), and
weights, gradients and optimizer state (which do not grow with the tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.nn.functional as F

import deltalab
import deltalab.layers.attention as attention_module
import deltalab.layers.kdn as kdn_layers
import deltalab.layers.recurrence as recurrence
from deltalab.errors import UserError
from deltalab.models.lm import CausalLM
from deltalab.models.presets import build_config
from deltalab.ops import _recompute
from deltalab.ops._recompute import Recipe, recipe_of
from deltalab.ops._triton import triton_unavailable_reason
from deltalab.ops.delta_rule.chunk import padded_chunk_size
from deltalab.ops.options import DEFAULT_OPTIONS, KernelOptions

PACKAGE = os.path.dirname(os.path.abspath(deltalab.__file__))


@dataclass
class Saved:
    """One storage saved for backward, as first seen."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    block: str
    origin: str
    producer: str
    kernel: bool
    # The values (for a copy a kernel would make: its source), for finding duplicates.
    tensor: torch.Tensor | None
    savers: set[str] = field(default_factory=set)


class Audit:
    """Records the storages one forward saves for backward."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.block = "head"
        self.quiet = 0  # > 0 inside a kernel whose saves are charged by formula
        self.saved: dict[object, Saved] = {}
        self.packed: list[tuple[object, torch.Tensor]] = []
        self.node = ""

    @staticmethod
    def origin() -> str:
        """The two innermost frames of deltalab on the stack."""
        frames = [
            f
            for f in traceback.extract_stack()
            if f.filename.startswith(PACKAGE) and not f.filename.endswith("_checks.py")
        ]
        return " < ".join(
            f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-2:])
        )

    def add(self, key, shape, dtype, nbytes, *, kernel, tensor, producer="", origin=""):
        if key not in self.saved:
            self.saved[key] = Saved(
                tuple(shape),
                dtype,
                nbytes,
                self.block,
                origin or self.origin(),
                producer,
                kernel,
                tensor,
            )
        return key

    def add_tensor(self, t: torch.Tensor, *, kernel: bool, origin: str = ""):
        storage = t.untyped_storage()
        producer = type(t.grad_fn).__name__ if t.grad_fn is not None else "leaf"
        key = (storage.data_ptr(), storage.nbytes())
        return self.add(
            key, t.shape, t.dtype, storage.nbytes(), kernel=kernel, tensor=t, producer=producer,
            origin=origin,
        )  # fmt: skip

    def add_new(self, shape, dtype, origin: str, source: torch.Tensor | None = None):
        """A tensor a kernel allocates and saves (no storage here to dedupe against)."""
        nbytes = math.prod(shape) * dtype.itemsize
        key = ("new", len(self.saved))
        self.add(key, shape, dtype, nbytes, kernel=True, tensor=source, producer="kernel",
                 origin=origin)  # fmt: skip

    def pack(self, t: torch.Tensor):
        if self.quiet:
            return t
        self.packed.append((self.add_tensor(t, kernel=False), t))
        return len(self.packed) - 1

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        key, t = self.packed[packed]
        if self.node:
            self.saved[key].savers.add(self.node)
        return t

    def charge_inputs(self, kernel: str, names: str, inputs, *, copies: bool) -> None:
        for name, x in zip(names, inputs, strict=True):
            recipe = recipe_of(x)
            if recipe is not None:
                # Not kept: rebuilt in the backward from what its recipe holds (free where its
                # own op's backward keeps that, as it should).
                for i, t in enumerate(recipe.tensors()):
                    self.add_tensor(
                        t, kernel=True, origin=f"{kernel} input {name} rebuilt: arg {i}"
                    )
            elif x.is_contiguous() or not copies:
                self.add_tensor(x, kernel=True, origin=f"{kernel} input {name}")
            else:
                self.add_new(x.shape, x.dtype, f"{kernel} input {name} (.contiguous() copy)", x)

    @contextlib.contextmanager
    def quieted(self):
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    @contextlib.contextmanager
    def patched(self, chunk_size: int):
        """delta_rule and SDPA charged as their CUDA kernels save (delta_rule with the
        `KernelOptions` the layer passes it); the blocks named."""
        real_delta_rule = recurrence.delta_rule
        real_sdpa = F.scaled_dot_product_attention

        def delta_rule(q, a, b, u, g, **kwargs):
            kernel = "delta_rule (Triton)"
            self.charge_inputs(kernel, "qabug", (q, a, b, u, g), copies=True)
            batch, length, heads, key_dim = q.shape
            value_dim, chunks = u.shape[-1], -(-length // chunk_size)
            options = kwargs.get("options") or DEFAULT_OPTIONS
            if options.recompute_states:
                # The backward walks them again from every checkpoint_every-th, which it keeps.
                kept = -(-chunks // options.checkpoint_every)
                shape = (batch, heads, kept, key_dim, value_dim)
                self.add_new(shape, torch.float32, f"{kernel} checkpointed chunk-start states")
            else:
                shape = (batch, heads, chunks, key_dim, value_dim)
                self.add_new(shape, torch.float32, f"{kernel} chunk-start states")
                shape = (batch, heads, chunks, padded_chunk_size(chunk_size), value_dim)
                self.add_new(shape, torch.float32, f"{kernel} residuals")
            with self.quieted():
                return real_delta_rule(q, a, b, u, g, **kwargs)

        def sdpa(q, k, v, **kwargs):
            with self.quieted():
                o = real_sdpa(q, k, v, **kwargs)
            kernel = "SDPA (flash)"
            self.charge_inputs(kernel, "qkvo", (q, k, v, o), copies=False)
            self.add_new(q.shape[:3], torch.float32, f"{kernel} logsumexp")
            return o

        real_pack, real_unpack = _recompute._pack, _recompute._unpack

        def rebuild_pack(t: torch.Tensor):
            # Inside `rebuilt_in_backward` its hooks replace this audit's: a tensor kept there
            # is recorded as any other save, one made again as the tensors its recipe holds.
            if self.quiet:
                return real_pack(t)
            recipe = recipe_of(t)
            if recipe is None:
                return self.pack(t)
            for i, held in enumerate(recipe.tensors()):
                self.add_tensor(held, kernel=False, origin=f"{self.origin()} rebuilt: arg {i}")
            return recipe

        def rebuild_unpack(packed):
            return packed() if isinstance(packed, Recipe) else self.unpack(packed)

        handles = []
        _recompute._pack, _recompute._unpack = rebuild_pack, rebuild_unpack
        for i, block in enumerate(self.model.model.blocks):
            name = f"block{i}"
            enter = block.register_forward_pre_hook(lambda *_, n=name: setattr(self, "block", n))
            leave = block.register_forward_hook(lambda *_: setattr(self, "block", "head"))
            handles += [enter, leave]
        recurrence.delta_rule = delta_rule
        attention_module.F = _Functional(sdpa)
        try:
            yield
        finally:
            recurrence.delta_rule = real_delta_rule
            attention_module.F = F
            _recompute._pack, _recompute._unpack = real_pack, real_unpack
            for handle in handles:
                handle.remove()

    def name_savers(self, root) -> None:
        """Walks the loss's graph; reading a node's saved tensors unpacks them, naming it."""
        seen, stack = set(), [root]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for attr in dir(node):
                if attr.startswith("_saved_"):
                    self.node = f"{node.name()}.{attr[len('_saved_') :]}"
                    with contextlib.suppress(Exception):  # some are not tensors
                        getattr(node, attr)
            if hasattr(node, "saved_tensors"):  # custom autograd Functions
                self.node = node.name()
                with contextlib.suppress(Exception):
                    _ = node.saved_tensors
            self.node = ""
            stack.extend(next_node for next_node, _ in node.next_functions)


class _Functional:
    """torch.nn.functional with scaled_dot_product_attention replaced."""

    def __init__(self, sdpa) -> None:
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name: str):
        return getattr(F, name)


def saved_storages(
    preset: str,
    mixer: str,
    length: int,
    layers: int,
    batch: int = 1,
    options: KernelOptions = DEFAULT_OPTIONS,
    recompute_ffn: bool = False,
) -> list[Saved]:
    """The storages the loss's graph saves, in the order first saved, with the model's
    kernel `options`."""
    torch.manual_seed(0)
    config = build_config(preset, mixer=mixer, num_layers=layers, backend="chunk",
                          kernel_options=options.to_dict())  # fmt: skip
    model = CausalLM(config).train()
    model.model.recompute_ffn = recompute_ffn  # as the trainer sets train.recompute_ffn
    with torch.no_grad():
        # Unit norm weights and zero-initialized gates would make distinct tensors hold equal
        # values (and look like duplicates): move them off their initial values.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif not param.any():
                param.normal_(std=0.02)
    ids = torch.randint(0, config.vocab_size, (batch, length))
    audit = Audit(model)
    # The KDN layers' gains as on the GPU: their Triton kernels (under the interpreter), whose
    # saves are recorded like any other. (The PyTorch parallel scan the "chunk" backend pairs
    # with keeps log2(T) levels of intermediates: a different count of storages per length.)
    kdn_scan = "parallel" if triton_unavailable_reason(torch.device("cpu")) else "triton"
    with (
        mock.patch.object(kdn_layers, "scan_backend", lambda backend, device: kdn_scan),
        audit.patched(config.chunk_size),
        torch.autograd.graph.saved_tensors_hooks(audit.pack, audit.unpack),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        loss = model(input_ids=ids, labels=ids).loss
    audit.name_savers(loss.grad_fn)
    loss.backward()
    # Saves of graph branches that do not reach the loss (freed with their branch) are dropped.
    return [s for s in audit.saved.values() if s.kernel or s.savers]


def per_token(short: list[Saved], long: list[Saved], tokens: int) -> list[tuple[Saved, float]]:
    """Matches the storages of two lengths in order: each with its bytes per token."""
    if len(short) != len(long):
        raise RuntimeError(f"the two lengths saved {len(short)} and {len(long)} storages")
    return [(b, (b.nbytes - a.nbytes) / tokens) for a, b in zip(short, long, strict=True)]


def duplicates(rows: list[tuple[Saved, float]]) -> dict[int, int]:
    """Row i -> an earlier row holding the same values (to bf16 rounding, any dtype/layout)."""
    found: dict[int, int] = {}
    for i, (row, _) in enumerate(rows):
        for j in range(i):
            t, u = row.tensor, rows[j][0].tensor
            if t is None or u is None or j in found or not t.numel() == u.numel() > 0:
                continue
            a, b = t.detach().float().reshape(-1), u.detach().float().reshape(-1)
            if a.abs().max() > 0 and torch.allclose(a, b, rtol=1e-2, atol=1e-3):
                found[i] = j
                break
    return found


def report(mixer: str, rows: list[tuple[Saved, float]], block: str, top: int) -> dict:
    """Prints the block's saves per token by storage; returns their totals."""
    mine = [(s, bpt) for s, bpt in rows if s.block == block and bpt > 0]
    total = sum(bpt for _, bpt in mine)
    layer = sum(bpt for s, bpt in mine if not s.kernel)
    by_dtype: dict[str, float] = defaultdict(float)
    for s, bpt in mine:
        by_dtype[str(s.dtype).removeprefix("torch.")] += bpt
    dtypes = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(by_dtype.items()))
    print(
        f"\n## {mixer}: {block} saves {total:,.0f} B/token (layer graph {layer:,.0f}, "
        f"kernel only {total - layer:,.0f}); by dtype: {dtypes}"
    )
    dup = duplicates(mine)
    print(f"duplicates (same values saved again): {sum(mine[i][1] for i in dup):,.0f} B/token")
    print("| # | B/token | shape | dtype | made by | saved by | where | same values as |")
    print("|---:|---:|---|---|---|---|---|---|")
    for i in sorted(range(len(mine)), key=lambda i: -mine[i][1])[:top]:
        s, bpt = mine[i]
        shape = "[" + ",".join(map(str, s.shape)) + "]"
        savers = ", ".join(sorted(s.savers)) or "kernel"
        same = f"#{dup[i]}" if i in dup else ""
        dtype = str(s.dtype).removeprefix("torch.")
        print(
            f"| {i} | {bpt:,.0f} | {shape} | {dtype} | {s.producer} | {savers} | {s.origin} "
            f"| {same} |"
        )
    head = sum(bpt for s, bpt in rows if s.block == "head")
    print(f"(outside the blocks: embedding, final norm, LM head, loss: {head:,.0f} B/token)")
    return {"block": block, "bytes_per_token": total, "layer_graph": layer,
            "by_dtype": dict(by_dtype), "outside_blocks": head}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="340M")
    parser.add_argument("--mixers", nargs="+", default=["gdn2", "muir", "transformer"])
    parser.add_argument(
        "--length",
        type=int,
        default=512,
        help="the shorter of the two lengths (a multiple of 8 chunks of 64, so that the Triton "
        "delta rule's checkpointed states, every checkpoint_every-th, grow with it)",
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--top", type=int, default=100, help="rows of each table")
    parser.add_argument(
        "--keep-states",
        action="store_true",
        help="charge the Triton delta rule as it saves with KernelOptions.recompute_states off "
        "(all chunk-start states and the residuals instead of every checkpoint_every-th state)",
    )
    parser.add_argument(
        "--keep-inputs",
        action="store_true",
        help="the delta rule keeps the inputs that cheap ops made (gate products, log decay) "
        "instead of rebuilding them in the backward (KernelOptions.rebuild_in_backward off)",
    )
    parser.add_argument(
        "--recompute-ffn",
        action="store_true",
        help="each block's FFN branch computed again in the backward (train.recompute_ffn)",
    )


def run(args: argparse.Namespace) -> dict:
    # The KDN gains run their Triton kernels here, on CPU tensors: Triton reads the variable when
    # the kernels are defined, so it must be set before the process imports deltalab. (Setting it
    # on import of this module would leak it into every later test or suite of the process.)
    if "kdn" in " ".join(args.mixers) and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(
            "the memory suite runs the KDN gains' Triton kernels on CPU tensors: "
            "run it as TRITON_INTERPRET=1 python -m benchmarks memory ..."
        )
    torch.set_num_threads(1)
    options = KernelOptions(
        recompute_states=not args.keep_states, rebuild_in_backward=not args.keep_inputs
    )
    results = {}
    for mixer in args.mixers:
        measure = dict(layers=args.layers, options=options, recompute_ffn=args.recompute_ffn)
        short = saved_storages(args.preset, mixer, args.length, **measure)
        long = saved_storages(args.preset, mixer, 2 * args.length, **measure)
        rows = per_token(short, long, args.length)
        results[mixer] = report(mixer, rows, f"block{args.layers - 1}", args.top)
    return {"device": "cpu", "mixers": results}
