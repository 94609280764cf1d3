"""CUDA autocast's policies on CPU, for `benchmarks.traffic`: fake tensors cannot be CUDA
tensors on a CPU build, so the traffic tool runs its step under CPU autocast with CUDA's op
lists (`cuda_autocast`): every op that CUDA's or CPU's autocast registers gets CUDA's policy on
the AutocastCPU key."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

# CUDA autocast's policies (ATen/autocast_mode.h): ops not named here that CUDA's autocast
# registers (`_dispatch_get_registrations_for_dispatch_key("AutocastCUDA")`) cast to float32.
CUDA_LOWER_PRECISION = frozenset(
    {"_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
     "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
     "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
     "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
     "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
     "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
     "cudnn_convolution", "cudnn_convolution_transpose"}
)  # fmt: skip
# float32 through the op's own dtype argument (no copy of the input).
CUDA_FP32_SET_OPT_DTYPE = frozenset(
    {"prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
     "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
     "sum.dim_IntList", "norm.Scalar", "norm.ScalarOpt_dim"}
)  # fmt: skip
CUDA_PROMOTE = frozenset(
    {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
     "index_put", "tensordot", "scatter_add"}
)  # fmt: skip
# Refused under CUDA autocast (an error there); passed through here.
CUDA_BANNED = frozenset({"binary_cross_entropy"})


def _op_overload(qualified: str):
    name, _, overload = qualified.removeprefix("aten::").partition(".")
    packet = getattr(torch.ops.aten, name, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _autocast_kernel(op, policy: str) -> Callable[..., Any]:
    """A kernel for the AutocastCPU key applying CUDA autocast's `policy` to `op`."""
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    arguments = [a.name for a in op._schema.arguments]

    def eligible(t: object, to: torch.dtype) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.dtype not in (torch.float64, to)
        )

    composite = op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "passthrough" and composite:
            # CUDA has no kernel here: its decomposition runs with autocast still on, so that
            # its parts get their own policies (cross_entropy_loss: log_softmax in float32).
            return op.decompose(*args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if policy in ("fp32", "lower"):
                to = torch.float32 if policy == "fp32" else torch.get_autocast_dtype("cpu")
                args, kwargs = torch.utils._pytree.tree_map(
                    lambda t: t.to(to) if eligible(t, to) else t, (args, kwargs)
                )
            elif policy == "promote":
                floats = [t.dtype for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor) and t.is_floating_point()]  # fmt: skip
                if floats:
                    widest = floats[0]
                    for dtype in floats[1:]:
                        widest = torch.promote_types(widest, dtype)
                    args, kwargs = torch.utils._pytree.tree_map(
                        lambda t: t.to(widest) if eligible(t, widest) else t, (args, kwargs)
                    )
            elif policy == "fp32_set_opt_dtype":
                # float32 through the dtype argument when the first argument is a lower-
                # precision float and no dtype is given (CUDA's set_opt_dtype).
                index = arguments.index("dtype")
                given = kwargs.get("dtype", args[index] if index < len(args) else None)
                if given is None and eligible(args[0], torch.float32):
                    args = args[:index]
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """CPU autocast with CUDA autocast's op lists, for the duration (see the module docstring).

    Ops CPU's autocast registers but CUDA's does not (e.g. `cross_entropy_loss`, `cat`) pass
    through; ops both run in lower precision keep CPU's kernel (it caches the bf16 copies of
    the weights within the autocast region, as CUDA's does)."""
    cuda = {n.removeprefix("aten::") for n in
            torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")}  # fmt: skip
    cpu = {n.removeprefix("aten::") for n in
           torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")}  # fmt: skip
    library = torch.library.Library("aten", "IMPL")
    try:
        for name in sorted(cuda | cpu):
            if name in CUDA_LOWER_PRECISION and name in cpu:
                continue
            op = _op_overload(name)
            if op is None:
                continue
            if name not in cuda or name in CUDA_BANNED:
                policy = "passthrough"
            elif name in CUDA_LOWER_PRECISION:
                policy = "lower"
            elif name in CUDA_FP32_SET_OPT_DTYPE:
                # norm.Scalar and norm.ScalarOpt_dim append a dtype; both are float32 here.
                policy = "fp32_set_opt_dtype" if "dtype" in str(op._schema) else "fp32"
            elif name in CUDA_PROMOTE:
                policy = "promote"
            else:
                policy = "fp32"
            with warnings_quiet():
                library.impl(name, _autocast_kernel(op, policy), "AutocastCPU")
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def warnings_quiet() -> Iterator[None]:
    """Overriding a kernel registered by PyTorch warns each time; these overrides are meant."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
