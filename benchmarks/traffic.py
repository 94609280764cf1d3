"""Where a training step's memory traffic comes from, per mixer, without a GPU.

    python -m benchmarks traffic --mixers gdn2 muir kdn_diag transformer \\
        --preset 340M --seq-len 4096 --batch 4

The training step's profile (`python -m benchmarks profile train`) measured on an H200 that
half of a 340M training step at 4K context is elementwise ops, reductions and copies, not the
delta-rule kernels or the matrix products. This tool says which modules and ops move those
bytes. It runs one step of
`profile_train.training_step` (forward and loss under bf16 autocast, backward, AdamW) on fake
tensors (`FakeTensorMode`: shapes, dtypes and strides, no data and no arithmetic), so the full
preset runs at the full batch and length on CPU in seconds, and records every aten op the step
dispatches with the bytes it moves:

- bytes: the memory each tensor argument and result spans (a broadcast dimension, stride 0,
  counts once), inputs read and results written; views cost nothing; an in-place or `out=` op
  writes its destination once (and reads it too, except copies and fills). A lower bound on
  DRAM traffic: a GPU kernel streaming through it may read an input twice or spill.
- scope: forward, the innermost `nn.Module` running (global module hooks keep a stack) and the
  innermost deltalab function on the Python stack. Backward, the scope is that of the forward
  op that made the autograd node being run: a `TorchFunctionMode` tags every new node
  (`node.metadata`) with the forward scope, and the backward reads
  `torch._C._current_autograd_node()`; a Python backward (an autograd.Function) or a recompute
  (`recomputed`, activation checkpointing) is named by its own deltalab frame. The gradient
  sums the autograd engine makes after a node returns (its forward input was used more than
  once: the residual stream, x into several projections) are told apart by a pre- and a
  post-hook on every tagged node: "(gradient sum) <the node's function>".
- categories: matrix products, attention, convolution, delta-rule and KDN kernels, optimizer
  (everything inside `optimizer.step`), and glue: everything else, the elementwise ops,
  reductions and copies that profile_train's `OTHER` times on the GPU.

What it models of a GPU run:

- CUDA autocast. Fake tensors cannot be CUDA tensors on a CPU build (autograd asks the CUDA
  device guard), so the step runs under CPU autocast with CUDA's op lists: while measuring,
  every op that CUDA's or CPU's autocast registers gets CUDA's policy on the AutocastCPU key
  (`cuda_autocast`), e.g. `exp`, `rsqrt`, `softplus` and `nll_loss` cast bf16 inputs to float32,
  `log_softmax` and `sum` compute in float32, `cross_entropy_loss` is not cast as a whole (it is
  on CPU).
- The Triton backends. The layers run `backend="auto"`, which takes the Triton kernels on CUDA.
  Here `triton_available` answers yes and every Triton launch is a stub that records the bytes
  of its tensor arguments as one op of the kernel's profile_train category: the delta rule, the
  KDN variance scan and the Mobius scan are opaque kernels, and the PyTorch code around them
  (their `.contiguous()` copies, zero fills, casts) is recorded as it runs, as glue of the
  function it runs in.
- Values: fake tensors have none. The value checks (`require_nonpositive`, the token-id range)
  still dispatch their comparison and reduction, as on the GPU (where they also synchronize);
  reading the answer back (`aten._local_scalar_dense`) gives the answer that passes (True from
  `all`, False from `any`, 1 from a number). Each read back is counted in its own category,
  host reads: on a GPU each one makes the host wait for the queue to drain.
- Not modeled: torch.compile, the allocator, kernel launch overhead, and any difference between
  CUDA's and CPU's decompositions of an op (the same composite ops decompose the same way; the
  CPU flash attention stands in for the CUDA one, both one opaque op).

Milliseconds are bytes at `--bandwidth` (default 3 TB/s, about what a streaming kernel reaches
on an H200's 4.8 TB/s); the generic strided kernels that dominate the measured profile run well
below that, so the estimate is a floor.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import deltalab
from benchmarks import profile_train
from benchmarks.cuda_autocast import cuda_autocast
from deltalab.benchmarking import format_table
from deltalab.errors import UserError
from deltalab.ops.options import KernelOptions

PACKAGE = os.path.dirname(os.path.abspath(deltalab.__file__))
ROOT = os.path.dirname(PACKAGE)
HERE = os.path.abspath(__file__)

GLUE = "glue"
MATMUL = "matrix products"
ATTENTION = "attention"
CONVOLUTION = "convolution"
DELTA = "delta-rule and KDN kernels"
OPTIMIZER = "optimizer"
# A value read back to the host (`.item()`, `bool(tensor)`: a value check): no bytes to speak
# of, but on a GPU the host waits there until every queued kernel has run, and the GPU idles
# until the host has queued the next ones.
HOST_READ = "host reads (syncs)"
CATEGORY_ORDER = (GLUE, MATMUL, DELTA, ATTENTION, CONVOLUTION, OPTIMIZER, HOST_READ)

MATMUL_OPS = frozenset(
    {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "dot", "mv", "addmv", "addr"}
)
# The backward of a convolution is one op too; conv1d etc. decompose to `convolution`.
CONVOLUTION_OPS = frozenset({"convolution", "convolution_backward", "_convolution"})
# Ops whose destination is only written: its old contents are not read.
WRITE_ONLY = frozenset(
    {"copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_", "exponential_"}
)
# Results that are new tensor headers over their input's memory but not marked as views in
# their schema, and allocations (nothing written until a kernel fills them).
FREE_OPS = frozenset(
    {"_unsafe_view", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
     "new_empty_strided", "_local_scalar_dense", "set_", "resize_"}
)  # fmt: skip


@dataclass
class Op:
    """One dispatched op of the step, or one Triton launch."""

    phase: str  # forward, backward, recompute (forward ops rerun in backward), optimizer
    path: str  # module path, block indices as *
    module: str  # module class
    function: str  # innermost deltalab function, file:qualname
    op: str  # aten op (overload dropped), or triton:<kernel>
    dtypes: str  # input dtypes -> output dtypes
    category: str
    read: int
    written: int
    node: str = ""  # the autograd node being run (backward)

    @property
    def bytes(self) -> int:
        return self.read + self.written


def accessed_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor spans: its elements, a broadcast (stride 0) dimension counted once."""
    if t.numel() == 0:
        return 0
    elements = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def _short_dtype(dtype: torch.dtype) -> str:
    return {
        torch.float32: "f32",
        torch.bfloat16: "bf16",
        torch.float16: "f16",
        torch.float64: "f64",
        torch.int64: "i64",
        torch.int32: "i32",
        torch.bool: "bool",
    }.get(dtype, str(dtype).removeprefix("torch."))


def _dtypes(tensors: list[torch.Tensor]) -> str:
    return ",".join(sorted({_short_dtype(t.dtype) for t in tensors})) or "-"


def op_category(op: str, phase: str) -> str:
    """The category of an aten op name (overload dropped) run in `phase`."""
    if op == "_local_scalar_dense":
        return HOST_READ
    if phase == "optimizer":
        return OPTIMIZER
    if op.startswith("triton:"):
        kernel = profile_train.category(op[7:])
        if kernel == CONVOLUTION:
            return CONVOLUTION
        # The norms', SwiGLU's, the log decay's and the read gate's kernels (deltalab.ops.norms,
        # .swiglu, .log_decay, .read_gate) replace glue ops: their bytes stay glue.
        return GLUE if kernel in (profile_train.NORMS_SWIGLU, profile_train.OTHER) else DELTA
    if op in MATMUL_OPS:
        return MATMUL
    if "scaled_dot_product" in op or "flash_attention" in op or "efficient_attention" in op:
        return ATTENTION
    if op in CONVOLUTION_OPS:
        return CONVOLUTION
    return GLUE


def op_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int, list, list]:
    """(bytes read, bytes written, input tensors, output tensors) of one aten op call."""
    name = func.__name__.split(".")[0]
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    schema = func._schema
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    # Views, allocations, and queries that return no tensor (prim.device, sym_size, ...).
    if func.is_view or name in FREE_OPS or not (outputs or mutates):
        return 0, 0, inputs, outputs
    mutated = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            mutated += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    if not mutated:
        read = sum(accessed_bytes(t) for t in inputs)
        return read, sum(accessed_bytes(t) for t in outputs), inputs, outputs
    # In place or out=: the results are the mutated arguments; each is written once, and read
    # unless the op only writes it (a copy, a fill).
    ids = {id(t) for t in mutated}
    read = sum(accessed_bytes(t) for t in inputs if id(t) not in ids)
    if name.removesuffix("_out") not in WRITE_ONLY:
        read += sum(accessed_bytes(t) for t in mutated)
    return read, sum(accessed_bytes(t) for t in mutated), inputs, mutated


# The value checks: a host read is charged to the function that called the check, or, for
# the checks queued in a `one_host_read` block (a training forward's), to the block's one read.
CHECKS = os.path.join(PACKAGE, "ops", "_checks.py")


def deltalab_frame() -> tuple[str, bool]:
    """The innermost deltalab function on the Python stack as `file:qualname` (path inside the
    package; the checks of `ops/_checks.py` are skipped for their caller, but for the read at
    the end of a `one_host_read` block), and whether a
    checkpoint recompute is under way above it."""
    frame = sys._getframe(2)
    found = ""
    recompute = False
    while frame is not None:
        filename = frame.f_code.co_filename
        charged = filename not in (HERE, CHECKS) or frame.f_code.co_name == "one_host_read"
        if not found and filename.startswith(PACKAGE) and charged:
            found = f"{os.path.relpath(filename, PACKAGE)}:{frame.f_code.co_qualname}"
        if filename.endswith(os.path.join("torch", "utils", "checkpoint.py")):
            recompute = recompute or frame.f_code.co_name in ("unpack_hook", "recompute_fn")
        frame = frame.f_back
    return found, recompute


SCOPE_KEY = "traffic_scope"


class Recorder:
    """The scopes and the ops of one measured step (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): re.sub(r"\.\d+(?=\.|$)", ".*", n) for n, m in model.named_modules()}
        self.names[id(model)] = "(model)"
        self.stack: list[tuple[str, str]] = []
        self.phase = "forward"
        # Backward: whether a node's own function is running (its pre-hook ran, its post-hook
        # not yet); between them the engine sums gradients of tensors used more than once.
        self.in_node = False
        self.recording = False
        self.ops: list[Op] = []

    def scope(self) -> tuple[str, str]:
        return self.stack[-1] if self.stack else ("(top)", "-")

    # Forward: module hooks.
    def push(self, module: nn.Module, *_: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append((name, type(module).__name__))

    def pop(self, module: nn.Module, _args: Any, output: Any) -> None:
        if self.names.get(id(module)) is not None:
            # Nodes made last in the module (an autograd.Function's result returned as is)
            # are first reached here, while the module is still the scope.
            self.tag(output)
            self.stack.pop()

    def tag(self, result: Any) -> None:
        """Tags every autograd node behind `result` not yet tagged with the current scope."""
        if self.phase != "forward":
            return
        pending = [
            t.grad_fn
            for t in tree_flatten(result)[0]
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        if not pending:
            return
        function, _ = deltalab_frame()
        scope = (*self.scope(), function)
        while pending:
            node = pending.pop()
            if node is None or SCOPE_KEY in node.metadata:
                continue
            node.metadata[SCOPE_KEY] = scope
            node.register_prehook(self._enter)
            node.register_hook(self._leave)
            pending.extend(n for n, _ in node.next_functions)

    def _enter(self, *_: Any) -> None:
        self.in_node = True

    def _leave(self, *_: Any) -> None:
        self.in_node = False

    def record(self, op: str, inputs: list, outputs: list, read: int, written: int) -> None:
        function, recompute = deltalab_frame()
        phase, node_name = self.phase, ""
        path, module = self.scope()
        if phase == "backward":
            node = torch._C._current_autograd_node()
            if node is None:
                path, module, origin = "(engine)", "-", "gradient sum"
            else:
                node_name = node.name()
                path, module, origin = node.metadata.get(SCOPE_KEY, ("(untagged)", "-", ""))
                if not self.in_node:
                    # The node has returned: the engine adds its gradient to another one for
                    # the same tensor (the node's forward input, used more than once).
                    function = f"(gradient sum) {origin}"
            # A Python backward or a recompute names itself; an aten backward its forward.
            function = function or origin
            if recompute:
                phase = "recompute"
        dtypes = f"{_dtypes(inputs)}->{_dtypes(outputs)}"
        self.ops.append(
            Op(
                phase,
                path,
                module,
                function,
                op,
                dtypes,
                op_category(op, phase),
                read,
                written,
                node_name,
            )
        )


class _Dispatch(TorchDispatchMode):
    """Records every aten op (below autograd and autocast: their casts and backward ops too)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        # Results of `any` (a check asking whether something is wrong), read back as False.
        # By id, with a weak reference to tell a reused id apart (a WeakSet compares tensors
        # with ==, which dispatches).
        self.any_results: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            # A value read back to the host: fake tensors have none. The answer that passes a
            # check (`all`: True, `any`: False); 1 is a valid token id and a step count that
            # AdamW can divide by. Counted as a host read, except the optimizer's: on a CPU
            # build (as here) AdamW takes its default step, which keeps the step counts on the
            # host, so reading them waits for nothing. (On CUDA the trainer's AdamW is fused and
            # keeps them on the GPU, read by its kernel, not by the host.)
            if self.recorder.recording and self.recorder.phase != "optimizer":
                self.recorder.record("_local_scalar_dense", [args[0]], [], 0, 0)
            if args[0].dtype == torch.bool:
                ref = self.any_results.get(id(args[0]))
                return ref is None or ref() is not args[0]
            return 1
        out = func(*args, **kwargs)
        if func.__name__.startswith("any") and isinstance(out, torch.Tensor):
            self.any_results[id(out)] = weakref.ref(out)
        if self.recorder.recording:
            read, written, inputs, outputs = op_bytes(func, args, kwargs, out)
            if outputs:  # not a query returning no tensor (prim.device, promote_types)
                name = func.__name__.split(".")[0]
                self.recorder.record(name, inputs, outputs, read, written)
        return out


class _NodeTagger(TorchFunctionMode):
    """Tags the autograd nodes each torch call makes in the forward with the current scope."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.recorder.tag(out)
        return out


def _triton_stub(recorder: Recorder) -> Callable[..., None]:
    def run(self, *args: Any, **kwargs: Any) -> None:
        if not recorder.recording:
            return
        fn = self
        while not hasattr(fn, "__name__") and hasattr(fn, "fn"):
            fn = fn.fn
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        total = sum(accessed_bytes(t) for t in tensors)
        # Reads and writes of a kernel are not told apart: all of its arguments count as read.
        recorder.record(f"triton:{fn.__name__}", tensors, [], total, 0)

    return run


@contextlib.contextmanager
def triton_stubbed(recorder: Recorder) -> Iterator[None]:
    """`backend="auto"` takes Triton on CPU tensors, and every launch only records its bytes."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    import deltalab.ops._triton as availability

    replacements = {
        availability.triton_available: lambda device: True,
        availability.require_triton: lambda name, device: None,
    }
    patched = []
    # The deltalab modules that imported these functions by name hold them too.
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("deltalab"):
            for attr, value in list(vars(module).items()):
                for original, replacement in replacements.items():
                    if value is original:
                        patched.append((module, attr, value))
                        setattr(module, attr, replacement)
    stub = _triton_stub(recorder)
    # Under TRITON_INTERPRET=1 `triton.jit` makes InterpretedFunctions instead of JITFunctions.
    launchers = [
        (jit.JITFunction, "run"),
        (interpreter.InterpretedFunction, "run"),
        (autotuner.Autotuner, "run"),
    ]
    saved = [(cls, attr, getattr(cls, attr)) for cls, attr in launchers]
    for cls, attr in launchers:
        setattr(cls, attr, stub)
    try:
        yield
    finally:
        for cls, attr, value in saved:
            setattr(cls, attr, value)
        for module, attr, value in patched:
            setattr(module, attr, value)


@contextlib.contextmanager
def _phases(recorder: Recorder, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Sets the recorder's phase: backward inside `Tensor.backward`, optimizer inside its step."""
    original = torch.Tensor.backward

    def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        recorder.phase = "backward"
        try:
            original(tensor, *args, **kwargs)
        finally:
            recorder.phase = "forward"

    def before(*_: Any) -> None:
        recorder.phase = "optimizer"

    def after(*_: Any) -> None:
        recorder.phase = "forward"

    handles = []
    if optimizer is not None:
        handles = [
            optimizer.register_step_pre_hook(before),
            optimizer.register_step_post_hook(after),
        ]
    torch.Tensor.backward = backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def recording(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[Recorder]:
    """Records the ops run inside while `recorder.recording` is set (set here; clear it for a
    warm-up), with scopes from `model`'s modules, Triton launches stubbed, the CUDA autocast
    lists and the phases (`optimizer`: its step is the optimizer phase)."""
    recorder = Recorder(model)
    recorder.recording = True
    with contextlib.ExitStack() as stack:
        # deltalab reads tensor addresses (`data_ptr`: keys of what it keeps, aliasing checks);
        # every fake tensor's is 0, so those checks see one address, which changes no byte
        # counted here; PyTorch warns at each read of one.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)
        stack.enter_context(cuda_autocast())
        stack.enter_context(triton_stubbed(recorder))
        stack.enter_context(_phases(recorder, optimizer))
        hooks = [
            nn.modules.module.register_module_forward_pre_hook(recorder.push),
            nn.modules.module.register_module_forward_hook(recorder.pop, always_call=True),
        ]
        stack.callback(lambda: [h.remove() for h in hooks])
        stack.enter_context(_Dispatch(recorder))
        stack.enter_context(_NodeTagger(recorder))
        yield recorder


def measure(
    mixer: str,
    preset: str,
    batch: int,
    seq_len: int,
    num_layers: int | None = None,
    kernel_options: KernelOptions | None = None,
) -> list[Op]:
    """The ops of one training step of `mixer` (`profile_train.training_step`, with the model's
    `kernel_options`) on fake tensors: the second step (the first makes AdamW's state)."""
    with FakeTensorMode():
        model, optimizer, step = profile_train.training_step(
            mixer, preset, batch, seq_len, "cpu", num_layers=num_layers, autocast=True,
            kernel_options=kernel_options,
        )  # fmt: skip
        with recording(model, optimizer) as recorder:
            recorder.recording = False
            step()
            recorder.recording = True
            step()
    return recorder.ops


def summarize(ops: list[Op], top: int, bandwidth: float) -> dict:
    """Totals per category and phase, the glue by fine key, by function and by module class
    (GB per step, ms at `bandwidth` bytes/s, calls per step)."""

    def entry(total: int, calls: int) -> dict:
        return {"gb": total / 1e9, "ms": total / bandwidth * 1e3, "calls": calls}

    def grouped(rows: list[Op], key: Callable[[Op], tuple]) -> list[dict]:
        sums: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for o in rows:
            s = sums[key(o)]
            s[0] += o.bytes
            s[1] += 1
        ranked = sorted(sums.items(), key=lambda kv: -kv[1][0])
        return [{"key": list(k), **entry(*v)} for k, v in ranked]

    categories = {c: entry(0, 0) for c in CATEGORY_ORDER}
    for row in grouped(ops, lambda o: (o.category,)):
        categories[row["key"][0]] = {k: row[k] for k in ("gb", "ms", "calls")}
    glue = [o for o in ops if o.category == GLUE]
    total = sum(o.bytes for o in ops)
    return {
        "total": entry(total, len(ops)),
        "categories": categories,
        "glue_by_phase": grouped(glue, lambda o: (o.phase,)),
        "glue_top": grouped(
            glue, lambda o: (o.phase, o.module, o.path, o.function, o.op, o.dtypes)
        )[:top],
        "glue_by_function": grouped(glue, lambda o: (o.function or o.module,))[:top],
        "glue_by_module": grouped(glue, lambda o: (o.module, o.path))[:top],
        "host_reads_by_function": grouped(
            [o for o in ops if o.category == HOST_READ], lambda o: (o.function or o.module,)
        )[:top],
    }


def _print_report(mixer: str, summary: dict, args: argparse.Namespace) -> None:
    total = summary["total"]
    print(
        f"\n{mixer}: {total['gb']:.1f} GB per step ({total['ms']:.1f} ms at "
        f"{args.bandwidth / 1e12:g} TB/s), {total['calls']} ops; preset {args.preset}, batch "
        f"{args.batch} x {args.seq_len} tokens, bf16 autocast (CUDA op lists)"
    )
    rows = [[c, v["gb"], v["ms"], v["calls"]] for c, v in summary["categories"].items()]
    print(format_table(["category", "GB", "ms", "ops"], rows))
    rows = [[r["key"][0], r["gb"], r["ms"], r["calls"]] for r in summary["glue_by_phase"]]
    print("\nglue by phase")
    print(format_table(["phase", "GB", "ms", "ops"], rows))
    print(f"\ntop glue contributors (of {summary['categories'][GLUE]['gb']:.1f} GB)")
    rows = [
        [r["gb"], r["ms"], r["calls"], phase, module, function[:44], op, dtypes]
        for r in summary["glue_top"]
        for phase, module, _path, function, op, dtypes in [r["key"]]
    ]
    print(format_table(["GB", "ms", "calls", "phase", "module", "function", "op", "dtypes"], rows))
    print("\nglue by deltalab function")
    rows = [[r["gb"], r["ms"], r["calls"], r["key"][0]] for r in summary["glue_by_function"]]
    print(format_table(["GB", "ms", "calls", "function"], rows))
    print("\nglue by module")
    rows = [[r["gb"], r["ms"], r["calls"], *r["key"]] for r in summary["glue_by_module"]]
    print(format_table(["GB", "ms", "calls", "module", "path"], rows))
    if summary["host_reads_by_function"]:
        print("\nhost reads (each a GPU sync) by deltalab function")
        rows = [[r["calls"], r["key"][0]] for r in summary["host_reads_by_function"]]
        print(format_table(["reads", "function"], rows))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", nargs="+", default=["gdn2", "transformer"])
    parser.add_argument("--preset", default="340M")
    parser.add_argument("--num-layers", type=int, default=None, help="default: the preset's")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--bandwidth", type=float, default=3e12, help="bytes/s for the ms estimate")
    parser.add_argument("--ops", action="store_true", help="also write every op to the JSON")
    parser.add_argument(
        "--keep-inputs",
        action="store_true",
        help="the delta rule keeps the inputs that cheap ops made instead of rebuilding them in\n"
        "the backward (KernelOptions.rebuild_in_backward off)",
    )


def run(args: argparse.Namespace) -> dict:
    if args.bandwidth <= 0:
        raise UserError(f"--bandwidth must be > 0, got {args.bandwidth}")
    options = KernelOptions(rebuild_in_backward=not args.keep_inputs)
    settings = ("mixers", "preset", "num_layers", "seq_len", "batch", "bandwidth", "keep_inputs")
    report: dict[str, Any] = {"settings": {k: str(getattr(args, k)) for k in settings}}
    for mixer in args.mixers:
        ops = measure(mixer, args.preset, args.batch, args.seq_len, args.num_layers, options)
        summary = summarize(ops, args.top, args.bandwidth)
        _print_report(mixer, summary, args)
        if args.ops:
            summary["ops"] = [asdict(o) for o in ops]
        report[mixer] = summary
    return report
