"""Input validation shared by the public ops.

Every error names the argument, what was received and what was expected. Nothing is broadcast
silently: a shape either matches exactly or the call is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence

import torch


def require_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def require_float(name: str, x: object) -> torch.Tensor:
    x = require_tensor(name, x)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def require_rank(name: str, x: torch.Tensor, ranks: Sequence[int], layout: str) -> None:
    if x.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have rank {want} ({layout}), got shape {tuple(x.shape)}")


def require_shape(
    name: str, x: torch.Tensor, expected: Sequence[int], layout: str, reason: str = ""
) -> None:
    if tuple(x.shape) != tuple(expected):
        why = f" {reason}" if reason else ""
        raise ValueError(
            f"{name} must have shape {layout} = {tuple(expected)}{why}, got {tuple(x.shape)}"
        )


def require_same_device(named: dict[str, torch.Tensor | None]) -> None:
    """Every tensor given (None: absent) on one device; a non-tensor (a list of offsets) is
    refused naming it, before its missing `.device` would."""
    present = {k: require_tensor(k, v) for k, v in named.items() if v is not None}
    if not present:
        return
    first_name, first = next(iter(present.items()))
    for other_name, other in present.items():
        if other.device != first.device:
            raise ValueError(
                f"{other_name} is on {other.device} but {first_name} is on {first.device}; "
                "all tensors must be on one device"
            )


def capturing(x: torch.Tensor) -> bool:
    """Whether x is a CUDA tensor and a CUDA graph is being captured on the current stream:
    then nothing may be read back to the host."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def values_checkable(x: torch.Tensor) -> bool:
    """Whether a check may read x's values: x is not empty, no CUDA graph is being captured and
    no `unchecked_values` block is open.

    Reading a value back to the host is forbidden during a capture.
    """
    return x.numel() > 0 and not capturing(x) and not _UNCHECKED.get()


# Set inside `unchecked_values`.
_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "deltalab_unchecked_values", default=False
)


@contextlib.contextmanager
def unchecked_values() -> Iterator[None]:
    """Inside: value checks are skipped (shapes, dtypes and devices still are checked).

    For a decoding step (`deltalab.models.static_decode`), whose op inputs a model's own
    layers computed from a prompt checked at its forward: a check there would read an answer
    back to the host in every layer of every token, the wait for the device the step exists to
    avoid, and a CUDA graph replays the step without any check anyway. The eager step and the
    replayed one then run the same operators.
    """
    token = _UNCHECKED.set(True)
    try:
        yield
    finally:
        _UNCHECKED.reset(token)


class NonFiniteError(ValueError):
    """A value check failed on NaN or an infinity: the numbers went wrong (a diverging training
    run), not the way the op was called. A ValueError like every other refusal; the training
    loop catches this subclass to apply its NaN policy."""


def _refusal(x: torch.Tensor) -> type[ValueError]:
    return ValueError if bool(torch.isfinite(x).all()) else NonFiniteError


class _Block:
    """The value checks queued in an open `one_host_read` block."""

    def __init__(self) -> None:
        # (on-device answer, the check to run again should it fail, x, the check's kind, x's
        # version when checked)
        self.queued: list[
            tuple[torch.Tensor, Callable[[], None], torch.Tensor, str, tuple[int, int] | None]
        ] = []
        # (_same_values(x), kind) of each queued check: the tensor x is a view of (its root,
        # by identity), where in it x starts, x's dtype, shape, strides and negation or
        # conjugation bits, and its version counter, so that another view over exactly x's
        # elements (a tensor routed through an autograd node, handed back as a view of itself)
        # is known too. The queue keeps x, hence its root, alive until the block ends, so the
        # root's id stays its own; views share their root's version counter. An alias with
        # its own storage handle (`x.data`, a DLPack import) has another root: checked again.
        self.keys: set[tuple[tuple, str]] = set()
        # The answers sent toward the host so far (`send_answers`), one conjunction per device
        # and send: (the CUDA event recorded behind its copy to pinned memory, or None where
        # the answer stays put: the CPU, another device, under torch.compile; the answer), and
        # how many of `queued` they cover.
        self.sent: list[tuple[torch.cuda.Event | None, torch.Tensor]] = []
        self.sent_count = 0
        # How many blocks are open inside this one (they add their checks to it): only the
        # outermost block's own code sends (`send_answers`).
        self.depth = 0

    def send(self) -> None:
        """Reduces the answers queued since the last send to one per device and starts their
        copy to the host: non-blocking into pinned memory, a CUDA event recorded behind it."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for passed, *_ in self.queued[self.sent_count :]:
            by_device.setdefault(passed.device, []).append(passed)
        self.sent_count = len(self.queued)
        # Traced by torch.compile (the checks break its graph where they read), the answers
        # stay on the device and are read at the end, as without a send.
        direct = torch.compiler.is_compiling()
        for device, answers in by_device.items():
            passed = torch.stack(answers).all()
            event = None
            if device.type == "cuda" and not direct:
                host = torch.empty((), dtype=torch.bool, pin_memory=True)
                host.copy_(passed, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                passed = host
            self.sent.append((event, passed))

    def answer(self) -> torch.Tensor:
        """Whether every queued check passed, as a 0-d bool on the host, to be read once: sends
        what is left, then waits for each copy's event (for a copy sent early, only for the
        work queued before it)."""
        self.send()
        for event, _ in self.sent:
            if event is not None:
                event.synchronize()
        # On the host: CUDA's are there (pinned), another device's move (that copy waits).
        return torch.stack([passed.cpu() for _, passed in self.sent]).all()


# The open `one_host_read` block (the outermost: blocks opened inside it add to it), or None.
_QUEUED: contextvars.ContextVar[_Block | None] = contextvars.ContextVar(
    "deltalab_queued_value_checks", default=None
)


@contextlib.contextmanager
def one_host_read() -> Iterator[None]:
    """The value checks inside the block read their answers back together, once, at its end.

    Each value check reads one bool back to the host, and on a GPU each read makes the host
    wait until every queued kernel has run, after which the GPU waits for the host to queue the
    next ones: a KDN layer checked 8 inputs one read at a time, 194 reads per 340M training
    step (benchmarks/traffic.py). Inside the block a check queues its on-device answer instead;
    on leaving, the answers are reduced per device, copied to the host and read in one go
    (`send_answers` can start that copy earlier). Only if one failed are the checks run again
    in order, so the error is the one the first failing check raises, word for word; and when
    the block's own code raises, the checks queued before the error are run first, as they
    would have read their answers before it outside a block: a failing one raises instead.

    The block may hold the work the checks guard too, when out-of-range values cannot make
    that work unsafe (a log decay > 0 gives inf or NaN, not an access out of bounds): the host
    then queues the work before it waits for the answers, and the device does not sit idle
    between the checks and the work while the host launches it. A failed check raises at the
    block's end, and the work's results are dropped. Checks of anything that indexes memory
    (offsets, lengths) must read back before the work, outside a block or in one of their own.

    Blocks nest: inside an enclosing block (the training loop wraps each forward) a block adds
    its checks to the enclosing one's, which reads them all at its own end.
    """
    enclosing = _QUEUED.get()
    if enclosing is not None:
        enclosing.depth += 1
        try:
            yield
        finally:
            enclosing.depth -= 1
        return
    block = _Block()
    token = _QUEUED.set(block)
    try:
        yield
    except BaseException as error:
        _QUEUED.reset(token)  # whatever was raised (an interrupt too): the block is closed
        if isinstance(error, Exception) and block.queued and not bool(block.answer()):
            _raise_first_failure(block)  # chained to `error`
        raise
    _QUEUED.reset(token)
    if not block.queued or bool(block.answer()):
        for _, _, x, kind, version in block.queued:
            _remember_pass(x, kind, version)
        return
    _raise_first_failure(block)
    raise AssertionError("a queued value check failed but passed when run again")


def _raise_first_failure(block: _Block) -> None:
    """Runs a block's queued checks again in order, outside it: each reads its answer at once
    and the first that fails raises its own error."""
    for _, check, *_ in block.queued:
        check()


def send_answers() -> None:
    """Inside a `one_host_read` block: starts the copy of the answers queued so far to the
    host, so that the block's end waits for that copy alone and not for the work queued after
    it. Call it between the checks and the work they guard, and keep the work in the block.

    Why: reading an answer back waits for everything queued before the read. Read before the
    work, the device idles while the host launches the work; read after it, the host waits for
    the device to drain the work and the device then idles while the host launches whatever
    follows (for a KDN op on the H200, the backward: 0.3-0.5 ms a call). A copy started
    between the two is done long before the block ends; waiting for its event costs neither
    side. Outside a block it does nothing (there the checks have read their answers already),
    and inside an enclosing block (the trainer's) too: that block reads once at its end, and a
    send per op would only add launches."""
    block = _QUEUED.get()
    # Not while a CUDA graph is captured: no check queues there, and a reduction recorded into
    # the graph would not run before the block's end read it.
    if (
        block is None
        or block.depth
        or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    ):
        return
    block.send()


# Checks passed once are not run again. An op that hands a validated input on to another op
# (KDN gives its g to the delta rule, which checks g <= 0 again) would otherwise reduce it a
# second time and, outside a block, read the answer back a second time: on a GPU one more
# wait for the device per call. A pass is remembered on the tensor, with its version counter
# and its data's address (an in-place write, through x or any view of it, bumps the counter,
# and `x.data = y` moves the address: either way the check runs again); a failure is never
# remembered. Inside a block, a check already queued for the same unchanged tensor is not
# queued twice: the block's one read answers both. Inference tensors (no version counter),
# tensors without storage and nested tensors are always checked.


def _version(x: torch.Tensor) -> tuple[int, int] | None:
    """x's version counter and where its data lives: `x.data = y` swaps the data without
    bumping the counter, so the address is part of what a pass is remembered for."""
    try:
        x.stride()  # a key of the block needs strides (a nested tensor has none)
        return x._version, x.data_ptr()
    except (RuntimeError, NotImplementedError):  # an inference tensor; one without storage
        return None


def _remember_pass(x: torch.Tensor, kind: str, version: tuple[int, int] | None) -> None:
    """Notes on x that the check `kind` passed on x at `version` (None: not noted)."""
    if version is not None:
        passes = getattr(x, "_deltalab_passed", None)
        if passes is None:
            passes = x._deltalab_passed = {}
        passes[kind] = version


def _settled(x: torch.Tensor, kind: str) -> bool:
    """Whether a check of this kind passed on x unchanged since, or is queued for it in the
    open block: nothing to do (see "Checks passed once" above)."""
    version = _version(x)
    if version is None:
        return False
    if getattr(x, "_deltalab_passed", {}).get(kind) == version:
        return True
    block = _QUEUED.get()
    return block is not None and (_same_values(x, version), kind) in block.keys


def share_passes(view: torch.Tensor, x: torch.Tensor) -> None:
    """Lets `view`, a view over exactly x's elements (as autograd hands back a tensor routed
    through a node), count the checks x passed as its own: a pass is remembered on the tensor
    object, which `view` is not. Without this, an op handed the view checks it again, and in a
    block that has sent its answers that check is read at the block's end, behind the work
    (on the H200 this cost Isotropic and Diagonal KDN 0.55-0.63 ms a call)."""
    passes = getattr(x, "_deltalab_passed", None)
    version = _version(view)
    if (
        passes
        and version is not None
        and _same_values(view, version) == _same_values(x, _version(x))
    ):
        view._deltalab_passed = dict(passes)


def _same_values(x: torch.Tensor, version: tuple[int, int] | None) -> tuple:
    """What makes two tensors read the same elements (see `_Block.keys`): the root they view,
    by identity, where they start in it, dtype, shape, strides, negation and conjugation
    (`z.conj().imag` views `z.imag`'s elements negated), and the version and address
    `_version` gives."""
    root = x if x._base is None else x._base
    layout = (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.is_neg(), x.is_conj())
    return id(root), *layout, version


def _failed(x: torch.Tensor, kind: str, passed: torch.Tensor, check: Callable[[], None]) -> bool:
    """Whether the check of x whose on-device answer is `passed` (a 0-d bool tensor) failed,
    read now. Inside `one_host_read` it is queued instead, with the check to run again should
    the block's read fail, and this returns False. A pass read here is remembered."""
    block, version = _QUEUED.get(), _version(x)
    if block is not None:
        block.queued.append((passed, check, x, kind, version))
        if version is not None:
            block.keys.add((_same_values(x, version), kind))
        return False
    if not bool(passed):
        return True
    _remember_pass(x, kind, version)
    return False


# One pass. A value check reduces x to one or two numbers (its maximum, minimum, or both from
# one `aminmax`) and compares those, rather than comparing every element into a bool tensor of
# x's size and reducing that: one read of x, nothing of its size written. On an H200 a KDN op's
# checks of its [B, T, H, K] inputs took ~0.15 ms the elementwise way. NaN needs no test of
# its own: amax, amin and aminmax return NaN when x holds one, and every comparison with NaN is
# False. The reductions take x detached: on a tensor that requires grad, amax would otherwise
# record a backward node that saves x (the elementwise comparisons it replaces record none).


def require_nonpositive(name: str, x: torch.Tensor, meaning: str) -> None:
    """Refuses values > 0 and NaN (-inf passes: a log decay of -inf is a full reset)."""
    if not values_checkable(x) or _settled(x, "<= 0"):
        return
    passed = x.detach().amax() <= 0  # see "One pass" above
    if _failed(x, "<= 0", passed, lambda: require_nonpositive(name, x, meaning)):
        # -inf is allowed here, so only NaN and +inf make the refusal a NonFiniteError.
        raise _refusal(x.nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0))(
            f"{name} must be <= 0 ({meaning}), got {_worst(x, 'maximum')}"
        )


def require_positive(name: str, x: torch.Tensor, meaning: str) -> None:
    """Refuses values <= 0 and NaN."""
    if not values_checkable(x) or _settled(x, "> 0"):
        return
    passed = x.detach().amin() > 0
    if _failed(x, "> 0", passed, lambda: require_positive(name, x, meaning)):
        raise _refusal(x)(f"{name} must be > 0 ({meaning}), got {_worst(x, 'minimum')}")


def _worst(x: torch.Tensor, reduce: str) -> str:
    if bool(x.isnan().any()):
        return "NaN"
    return f"a {reduce} of {getattr(x, reduce[:3])().item():.4g}"


def require_nonnegative(name: str, x: torch.Tensor, meaning: str) -> None:
    """Refuses values < 0 and NaN."""
    if not values_checkable(x) or _settled(x, ">= 0"):
        return
    passed = x.detach().amin() >= 0
    if _failed(x, ">= 0", passed, lambda: require_nonnegative(name, x, meaning)):
        raise _refusal(x)(f"{name} must be >= 0 ({meaning}), got {_worst(x, 'minimum')}")


def require_finite(name: str, x: torch.Tensor, meaning: str) -> None:
    """Refuses inf, -inf and NaN; the error shows the first such value and where it is."""
    if not values_checkable(x) or _settled(x, "finite"):
        return
    low, high = torch.aminmax(x.detach())
    passed = (low > -math.inf) & (high < math.inf)
    if not _failed(x, "finite", passed, lambda: require_finite(name, x, meaning)):
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise NonFiniteError(f"{name} must be finite ({meaning}), got {x[index].item()} at {index}")


def _require_bounded(name: str, x: torch.Tensor, meaning: str, positive: bool) -> None:
    """require_positive (`positive`) or require_nonnegative, then require_finite, from one pass
    over x: its minimum and maximum together. On a failure the two checks run in order, so the
    error is the one they raise one after the other."""
    kind = "> 0, finite" if positive else ">= 0, finite"
    if not values_checkable(x) or _settled(x, kind):
        return
    low, high = torch.aminmax(x.detach())
    passed = (low > 0 if positive else low >= 0) & (high < math.inf)

    def in_order() -> None:
        (require_positive if positive else require_nonnegative)(name, x, meaning)
        require_finite(name, x, meaning)

    if _failed(x, kind, passed, in_order):
        in_order()


def require_nonnegative_finite(name: str, x: torch.Tensor, meaning: str) -> None:
    """require_nonnegative, then require_finite, in one pass over x."""
    _require_bounded(name, x, meaning, positive=False)


def require_positive_finite(name: str, x: torch.Tensor, meaning: str) -> None:
    """require_positive, then require_finite, in one pass over x."""
    _require_bounded(name, x, meaning, positive=True)


def require_positive_int(name: str, value: object) -> int:
    """`value` as an int > 0; the error names the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def require_positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive number, got {type(value).__name__}")
    value = float(value)
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return value


def require_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


def state_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64, else float32: the dtype states are kept in.

    Not `deltalab.layers.common.compute_dtype(x)`, which widens one activation to at least
    float32 (a bfloat16 x gives float32 there, a float64 x float64; float16 and float32 inputs
    here all give float32)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def check_cu_seqlens(
    cu_seqlens: object, batch: int, length: int, device: torch.device
) -> torch.Tensor:
    """Validates packed-sequence offsets `[N+1]`; returns them as an int64 tensor on `device`.

    The backends take this tensor (no host copy), so a call syncs with the device once, here:
    the value checks read four numbers back in one transfer (one more, on the error path, to
    quote a non-increasing pair). During a CUDA graph capture nothing may be read back, so only
    the dtype, shape and device are checked, as `values_checkable` does for every value check.
    """
    cu = require_tensor("cu_seqlens", cu_seqlens)
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got dtype {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor [N+1] with N >= 1, got shape {tuple(cu.shape)}"
        )
    if cu.device != device:
        raise ValueError(f"cu_seqlens is on {cu.device} but the inputs are on {device}")
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences along T and needs B == 1, got B = {batch}")
    # int64 before any arithmetic: differences of unsigned offsets would wrap around.
    cu = cu.to(torch.int64)
    # Offsets this function already passed for the same T, unchanged since (an in-place write
    # bumps the tensor's version), are not read back again: a KDN op checks them, then hands
    # the returned tensor to delta_rule, which would otherwise sync a second time.
    if getattr(cu, "_deltalab_checked", None) == (length, cu._version):
        return cu
    if not values_checkable(cu):
        return cu
    steps = cu[1:] - cu[:-1]
    # argmax of a bool mask is the first True (0 when there is none; `bad` tells which).
    first_bad = (steps <= 0).to(torch.uint8).argmax()
    bad = (steps <= 0).any().to(torch.int64)
    # The one device -> host sync of validation.
    start, end, has_bad, at = torch.stack([cu[0], cu[-1], bad, first_bad]).tolist()
    if start != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {start}")
    if end != length:
        raise ValueError(f"cu_seqlens must end at T = {length}, got {end}")
    if has_bad:
        before, after = cu[at : at + 2].tolist()
        raise ValueError(
            f"cu_seqlens must be strictly increasing, got {before} then {after} "
            f"at positions {at}, {at + 1}"
        )
    cu._deltalab_checked = (length, cu._version)
    return cu
