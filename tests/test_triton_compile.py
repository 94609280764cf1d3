"""The Triton kernels compile for a Hopper GPU (sm_90) and fit its shared memory, checked on CPU.

The interpreter runs the kernels' arithmetic but not NVIDIA's compiler, which refuses what the
interpreter accepts (a tl.dot inner dimension below 8; more shared memory than an SM has: both
happened here). Compiling ahead of time for sm_90 needs no GPU.

With any Triton from the range pyproject.toml allows, every kernel must compile and fit the
SM's shared memory. The spill bounds are measurements of the Triton constraints.txt pins: other
releases allocate registers otherwise (3.6 spills 16 to 80 bytes a thread in a few kernels
these bounds hold at 0 to 24), so with them a spill past its bound is a warning, not a failure.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from pathlib import Path

import pytest
import torch

from deltalab.ops import _triton
from deltalab.ops._triton import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(
    not HAS_TRITON or INTERPRET, reason="needs Triton, compiling (not interpreting) kernels"
)

# Shared memory per SM usable by one block on an H100/H200 (227 KiB).
HOPPER_SHARED_BYTES = 232448

# The Triton release the spill bounds were measured on: the one constraints.txt pins.
PINNED_TRITON = re.search(
    r"^triton==(\S+)$",
    (Path(__file__).resolve().parent.parent / "constraints.txt").read_text(encoding="utf-8"),
    re.MULTILINE,
).group(1)


def _compile_for_hopper(kernel, pointers, scalars, constants, options, types=None, aligned=()):
    """`types` overrides a pointer's "*fp32"; the arguments in `aligned` are declared multiples
    of 16 (pointers: 16-byte aligned), as Triton's launcher declares them for such values.
    The constexprs `constants` leaves out take their defaults, as the launcher gives them."""
    constants = {
        **{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default},
        **constants,
    }
    signature = {
        **{p: "*fp32" for p in pointers},
        **(types or {}),
        **{s: "fp32" if s in ("scale", "eps", "E") else "i32" for s in scalars},
        **{k: "constexpr" for k in constants},
    }
    return _compile_signature(kernel, signature, constants, options, aligned)


def _compile_signature(kernel, signature, constants, options, aligned):
    """Compiles `kernel` for sm_90 with `signature` (every argument's type, "constexpr" for
    those in `constants`), the arguments in `aligned` declared multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index = kernel.arg_names.index
    constexprs = {(index(k),): v for k, v in constants.items()}
    attrs = {(index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _stack_bytes(compiled) -> int | None:
    """Bytes of stack a thread of the compiled kernel uses (registers spilled to local memory),
    by the cuobjdump Triton ships; None when it ships none."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [str(tool), "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def _assert_spills_within(compiled, bound: int, what: str) -> None:
    """Asserts a thread of `compiled` uses at most `bound` bytes of stack (spilled registers)
    with the pinned Triton (PINNED_TRITON); with another release, warns past the bound."""
    import triton

    stack = _stack_bytes(compiled)
    if stack is None or stack <= bound:
        return
    message = f"{what}: {stack} bytes of stack per thread, bound {bound}"
    if triton.__version__ == PINNED_TRITON:
        raise AssertionError(message)
    warnings.warn(
        f"Triton {triton.__version__}: {message} (measured on {PINNED_TRITON})", stacklevel=2
    )


def _assert_compiles_without_spills(
    kernel, n_pointers, constants, warps, activations=None, *, aligned_scalars=False, what=""
):
    """Compiles `kernel` for sm_90 with its first `n_pointers` arguments as pointers ("*fp32"
    unless `activations` names another type), `constants` as constexprs and the rest as
    scalars; asserts it fits the SM's shared memory and spills nothing to local memory.
    Pointers are declared 16-byte aligned (and the scalars multiples of 16 with
    `aligned_scalars`), as the launcher declares them. Returns the compiled kernel."""
    pointers = kernel.arg_names[:n_pointers]
    scalars = [a for a in kernel.arg_names[n_pointers:] if a not in constants]
    types = {p: (activations or {}).get(p, "*fp32") for p in pointers}
    aligned = [*pointers, *scalars] if aligned_scalars else pointers
    compiled = _compile_for_hopper(
        kernel, pointers, scalars, constants, {"num_warps": warps}, types, aligned=aligned
    )
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES, what
    _assert_spills_within(compiled, 0, what)
    return compiled


@pytest.mark.parametrize(("key_dim", "chunk"), [(3, 256), (128, 64), (256, 128)])
def test_delta_rule_kernels_compile_for_hopper_within_shared_memory(key_dim, chunk):
    from deltalab.ops.delta_rule.triton import factors, intra, solve
    from deltalab.ops.delta_rule.triton.intra import DIAGONAL_FACTOR_BOUND, SUB_BLOCK, key_block
    from deltalab.ops.delta_rule.triton.launch import LAUNCH
    from deltalab.ops.delta_rule.triton.state_pass import _launch
    from deltalab.ops.delta_rule.triton.state_pass_kernels import (
        _operator_grads_kernel,
        _state_pass_bwd,
        _state_pass_fwd,
    )

    block_k = key_block(key_dim)
    for precision in ("ieee", "tf32"):
        # The state pass's own launch constants and options, as `state_pass_triton` uses them.
        _, launch = _launch(key_dim, 1, chunk, key_dim, precision)
        options = {k: launch.pop(k) for k in ("num_warps", "num_stages")}
        shape = dict(K=key_dim, C=chunk, BT=SUB_BLOCK, PRECISION=precision)
        block_kd = min(factors.LAUNCH.block, block_k)
        block_n = min(solve.LAUNCH.block, block_k)
        columns = dict(N=key_dim, C=chunk, BT=SUB_BLOCK, BN=block_n, PRECISION=precision)
        # Both decay layouts over the cases: one log decay per head at K = 3.
        g_head = {"G_HEAD": key_dim == 3}
        per_chunk = dict(K=key_dim, C=chunk, BKD=block_kd, **g_head)
        # Stage 1 with its own launch, channel block and factored-diagonal bound.
        stage_1 = {**shape, **g_head, "BOUND": DIAGONAL_FACTOR_BOUND}
        intra_kd = min(intra.LAUNCH.block, block_k)
        kernels = [
            (_state_pass_fwd, 11, {**launch, "HAS_INITIAL": True, **WIDENED}, options),
            (_state_pass_fwd, 11, {**launch, "HAS_INITIAL": True, "WRITE_OUT": False, **WIDENED},
             options),
            (_state_pass_bwd, 10, {**launch, "HAS_D_FINAL": True, **WIDENED}, options),
            (intra._intra_fwd, 8, {**stage_1, "BK": block_k}, intra.LAUNCH.options),
            (intra._intra_bwd, 11, {**stage_1, "BKD": intra_kd}, intra.LAUNCH.options),
            (solve._solve_fwd, 3, columns, solve.LAUNCH.options),
            (solve._solve_bwd, 4, {**columns, "TOKENS": True}, solve.LAUNCH.options),
            (solve._lower_grad, 5, {**shape, "V": key_dim, "BK": block_n, "BV": block_n},
             solve.LAUNCH.options),
            (factors._factors_fwd, 10, per_chunk, factors.LAUNCH.options),
            (factors._factors_bwd, 17, per_chunk, factors.LAUNCH.options),
        ]  # fmt: skip
        # Stage 1 and the factors with a as a direction per token and as a strength per token
        # (A_ROW: DeltaNet, GDN, KDA, Isotropic KDN), and with q and b made unit-norm on load
        # (UNIT: qk_l2norm), each a variant of its own.
        reads_a = {intra._intra_fwd, intra._intra_bwd, factors._factors_fwd, factors._factors_bwd}
        kernels = [case for case in kernels if case[0] not in reads_a] + [
            (kernel, n, {**constants, "A_ROW": row, "UNIT": unit}, kernel_options)
            for kernel, n, constants, kernel_options in kernels
            if kernel in reads_a
            for row in (False, True)
            for unit in (False, True)
        ]
        grads = dict(K=key_dim, V=key_dim, C=chunk, BK=block_k, PRECISION=precision,
                     BV=min(LAUNCH.operator_block_v, block_k),
                     BC=min(chunk, LAUNCH.block_c))  # fmt: skip
        kernels += [
            (_operator_grads_kernel, 10, {**grads, "FROM_OUTPUT": from_output},
             {"num_warps": LAUNCH.num_warps, "num_stages": 1})
            for from_output in (True, False)
        ]  # fmt: skip
        kernels += _split_state_pass_kernels(key_dim, chunk, precision)
        # TF32 is what 16-bit inputs get: with 16-bit operators (operator_dtype "inputs", the
        # default) and with float32 ones.
        operators = ["*fp32", "*bf16"] if precision == "tf32" else ["*fp32"]
        cases = list(itertools.product(kernels, operators))
        if precision == "tf32":
            cases += [(kernel, "*bf16")
                      for kernel in _fused_16bit_kernels(key_dim, chunk, precision)]  # fmt: skip
            # The walks as bf16 operators run them by default: products in bf16 (walk_dots).
            cases += [((kernel, n, {**constants, "LOW_DOTS": True}, kernel_options), "*bf16")
                      for kernel, n, constants, kernel_options in kernels
                      if "LOW_DOTS" in constants]  # fmt: skip
        for (kernel, n_pointers, constants, kernel_options), stored in cases:
            pointers = kernel.arg_names[:n_pointers]
            scalars = [a for a in kernel.arg_names[n_pointers:] if a not in constants]
            types = {p: stored for p in pointers if p in OPERATOR_POINTERS}
            compiled = _compile_for_hopper(
                kernel, pointers, scalars, constants, kernel_options, types
            )
            assert compiled.metadata.shared <= HOPPER_SHARED_BYTES, (
                kernel.fn.__name__, stored, kernel_options
            )  # fmt: skip


# The fused walks' products widened to float32, as walk_dots "float32" launches them (a
# default of LOW_DOTS, named for the cases that set it otherwise).
WIDENED = {"LOW_DOTS": False}

# The delta rule's kernels' pointers to the chunk operators, stored in the inputs' 16-bit dtype
# with operator_dtype "inputs", and to the outputs in the inputs' dtype (`out`;
# the solve's `out` is the erase or the target operator).
OPERATOR_POINTERS = {"read", "attend", "erase", "target", "write", "rhs", "out"}


def _walks_at_stages(table, field: str, depths, launch, walks):
    """Each walk of `walks` ((kernel, pointers, flag set True)) at the constants and options
    `launch(table)` returns with the launch table's `field` set to each of `depths`: (kernel,
    pointers, constants, options) as the test above takes them."""
    kernels = []
    for stages in depths:
        constants = launch(dataclasses.replace(table, **{field: stages}))
        options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}
        kernels += [(kernel, n, {**constants, flag: True}, options) for kernel, n, flag in walks]
    return kernels


def _fused_16bit_kernels(key_dim, chunk, precision):
    """The fused state pass's walks at the launches `_launch` gives 16-bit operators: at
    block_v with every pipeline depth the tuner offers (num_stages 2 and 3; K > 128 keeps 1),
    and the narrow launch (narrow_block_v, narrow_num_stages 2 and 3), made to apply by a
    program threshold its walks reach and block_v's do not."""
    from deltalab.ops.delta_rule.triton.launch import LAUNCH
    from deltalab.ops.delta_rule.triton.state_pass import _launch
    from deltalab.ops.delta_rule.triton.state_pass_kernels import _state_pass_bwd, _state_pass_fwd

    walks = [(_state_pass_fwd, 11, "HAS_INITIAL"), (_state_pass_bwd, 10, "HAS_D_FINAL")]

    def launch(table):  # the launches widened products get (walk_dots "float32")
        return _launch(key_dim, 1, chunk, key_dim, precision, torch.bfloat16, "float32", table)[1]

    table = LAUNCH
    kernels = _walks_at_stages(table, "num_stages", (2, 3), launch, walks)
    narrow = dataclasses.replace(table, fused_pass_min_programs=-(-key_dim // table.narrow_block_v))
    kernels += _walks_at_stages(narrow, "narrow_num_stages", (2, 3), launch, walks)
    return [(kernel, n, {**constants, **WIDENED}, options)
            for kernel, n, constants, options in kernels]  # fmt: skip


def _split_state_pass_kernels(key_dim, chunk, precision):
    """The split state pass's kernels at its launches, its walks with every pipeline depth the
    tuner offers (split_num_stages 1 and 2; K > 128 keeps 1)."""
    from deltalab.ops.delta_rule.triton.launch import LAUNCH
    from deltalab.ops.delta_rule.triton.state_pass import _split_launch
    from deltalab.ops.delta_rule.triton.state_pass_kernels import (
        _state_pass_split_bwd,
        _state_pass_split_dout,
        _state_pass_split_fwd,
        _state_pass_split_out,
    )

    kernels = _walks_at_stages(
        LAUNCH, "split_num_stages", (1, 2),
        lambda table: {**_split_launch(key_dim, chunk, key_dim, precision, table)[0], **WIDENED},
        [(_state_pass_split_fwd, 8, "HAS_INITIAL"), (_state_pass_split_bwd, 7, "HAS_D_FINAL")],
    )  # fmt: skip
    _, parallel = _split_launch(key_dim, chunk, key_dim, precision)
    options = {k: parallel.pop(k) for k in ("num_warps", "num_stages")}
    kernels += [
        (_state_pass_split_out, 5, parallel, options),
        (_state_pass_split_dout, 6, parallel, options),
    ]
    return kernels


@pytest.mark.parametrize("chunk", [64, 128])
def test_16bit_products_keep_the_fused_walks_within_their_spill_bounds(chunk):
    """With bf16 operators and walk_dots "operators" (LOW_DOTS, the default), the fused state
    pass's walks, forward and adjoint, at the launches "auto" gives them (block_v with
    low_dots_num_warps and low_dots_num_stages where its walks are enough, the narrow launch
    where only its own are) fit the SM's shared memory and spill nothing (K = V = 128), but
    what LOW_DOTS_SPILL_BOUND allows at chunks of 128. With
    the products widened to float32, Triton 3.9 spills 192 to 352 bytes a thread in the forward
    walk at such launches: what KernelOptions.walk_dots "operators" avoids."""
    from deltalab.ops.delta_rule.triton.launch import LAUNCH
    from deltalab.ops.delta_rule.triton.state_pass import _launch
    from deltalab.ops.delta_rule.triton.state_pass_kernels import _state_pass_bwd, _state_pass_fwd

    types = {p: "*bf16" for p in OPERATOR_POINTERS}
    walks = ((_state_pass_fwd, 11, "HAS_INITIAL"), (_state_pass_bwd, 10, "HAS_D_FINAL"))
    # 96 sequences and heads: block_v's launch (192 walks); 24: the narrow one (96 walks at 32
    # columns, 48 at 64); asserted, so that the test compiles the launches it names.
    table = LAUNCH
    counts = (table.fused_pass_min_programs, table.fused_pass_min_programs // 4)
    launches = []
    for programs in counts:
        _, launch = _launch(128, programs, chunk, 128, "tf32", torch.bfloat16)
        launches.append((launch["BV"], launch["num_warps"], launch["num_stages"]))
    assert launches == [
        (table.block_v, table.low_dots_num_warps, table.low_dots_num_stages),
        (table.narrow_block_v, table.narrow_num_warps, table.narrow_num_stages),
    ]
    for programs in counts:
        _, launch = _launch(128, programs, chunk, 128, "tf32", torch.bfloat16)
        options = {k: launch.pop(k) for k in ("num_warps", "num_stages")}
        for kernel, n_pointers, flag in walks:
            pointers = kernel.arg_names[:n_pointers]
            constants = {**launch, flag: True, "LOW_DOTS": True}
            scalars = [a for a in kernel.arg_names[n_pointers:] if a not in constants]
            compiled = _compile_for_hopper(
                kernel, pointers, scalars, constants, options,
                {p: t for p, t in types.items() if p in pointers}, aligned=pointers,
            )  # fmt: skip
            assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
            what = f"{kernel.fn.__name__} at {options}, BV {launch['BV']}"
            allowed = LOW_DOTS_SPILL_BOUND.get((kernel.fn.__name__, chunk, launch["BV"]), 0)
            _assert_spills_within(compiled, allowed, what)


# Bytes a thread the 16-bit walks may spill, by (kernel, chunk, value columns), as measured
# (Triton 3.9, sm_90): at chunks of 128 the forward and adjoint walks at block_v's launch (64
# columns, 4 warps, 2 stages) spill 80 and 24 (the forward writing its outputs and residuals,
# WRITE_OUT and STORE_RESIDUAL constexprs as the launcher passes them); that launch was timed at
# chunks of 64, the presets' size, where nothing spills.
LOW_DOTS_SPILL_BOUND = {("_state_pass_fwd", 128, 64): 80, ("_state_pass_bwd", 128, 64): 24}


@pytest.mark.parametrize("operators", ["fp32", "bf16"])
@pytest.mark.parametrize("key_dim", [128, 256])
def test_split_state_pass_parallel_kernels_compile_for_hopper_without_spills(key_dim, operators):
    """The split state pass's kernels parallel over chunks (the outputs forward, P and Q
    backward) at their launch (split_block_v, split_num_warps), with TF32 products and the
    chunk operators in float32 or bf16, at the presets' K = 128 and at K = 256: no spill to
    local memory."""
    from deltalab.ops.delta_rule.triton.state_pass import _split_launch
    from deltalab.ops.delta_rule.triton.state_pass_kernels import (
        _state_pass_split_dout,
        _state_pass_split_out,
    )

    _, parallel = _split_launch(key_dim, 64, key_dim, "tf32")
    warps = parallel.pop("num_warps")
    parallel.pop("num_stages")
    types = {p: f"*{operators}" for p in OPERATOR_POINTERS}
    for kernel, n_pointers in ((_state_pass_split_out, 5), (_state_pass_split_dout, 6)):
        _assert_compiles_without_spills(
            kernel, n_pointers, parallel, warps, types, what=f"{kernel.fn.__name__} K={key_dim}"
        )


@pytest.mark.parametrize(
    ("width", "dtype"), [(4, "bf16"), (3, "fp32"), (8, "fp32")], ids=["W4-bf16", "W3", "W8"]
)
def test_short_conv_kernels_compile_for_hopper_without_spills(width, dtype):
    """At the launches `short_conv` uses for C = 2048, the variant that reads the cache and
    writes its gradient (the most registers): no spill to local memory, which in a
    bandwidth-bound kernel would add traffic of its own."""
    from deltalab.ops.short_conv import triton as short_conv

    activations = {name: f"*{dtype}" for name in ("X", "CACHE", "Y", "DY", "DX", "DCACHE")}
    flags = {"HAS_CACHE": True, "SILU": True}
    kernels = [
        (short_conv._short_conv_fwd, "forward", 4, flags),
        (short_conv._short_conv_bwd, "backward", 7, {**flags, "HAS_DCACHE": True}),
    ]
    for kernel, name, n_pointers, constants in kernels:
        block_t, block_c, warps = short_conv.launch(2048, width, name)
        constants = {**constants, "W": width, "BT": block_t, "BC": block_c}
        # Every size a multiple of 16 (T, C = 2048, the block counts), as at the benchmark's.
        _assert_compiles_without_spills(
            kernel, n_pointers, constants, warps, activations, aligned_scalars=True,
            what=f"{name} W={width} {dtype}",
        )  # fmt: skip


@pytest.mark.parametrize(
    ("dim", "dtype"),
    [(128, "bf16"), (1024, "fp32"), (4096, "fp32"), (100, "fp32")],
    ids=["head-bf16", "block-1024", "block-4096", "odd"],
)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_norm_kernels_compile_for_hopper_without_spills(dim, dtype, gated):
    """At the launches the norms use for 340M shapes (head_dim 128 rows, hidden 1024, and the
    widest block norm planned, 4096): no spill to local memory."""
    from deltalab.ops.norms import triton as norms

    gate = {"GATE_ACT": norms.SILU if gated else norms.NO_GATE, "MEAN": True, "HAS_WEIGHT": True}
    activations = {name: f"*{dtype}" for name in ("X", "GATE", "Y", "DY", "DX", "DGATE")}
    kernels = [
        (norms._norm_fwd, "forward", 5, gate),
        (
            norms._norm_bwd,
            "backward",
            8,
            # The plain case also reads xhat as given, as the L2 normalization's backward does.
            {**gate, "WANT_DGATE": gated, "WANT_DW": True, "XHAT_GIVEN": not gated},
        ),
    ]
    for kernel, name, n_pointers, constants in kernels:
        block_m, block_n, warps = norms.launch(1 << 16, dim, name)
        constants = {**constants, "BM": block_m, "BN": block_n}
        _assert_compiles_without_spills(
            kernel, n_pointers, constants, warps, activations, what=f"{name} N={dim} {dtype}"
        )


@pytest.mark.parametrize("key_dim", [64, 128, 256])
@pytest.mark.parametrize("g_head", [False, True], ids=["channel_decay", "head_decay"])
def test_kdn_gain_kernels_compile_for_hopper_without_spills(key_dim, g_head):
    """The fused KDN gain (Diagonal) and terms (Isotropic), at the launches they use for
    T = 4096 (the backwards with dp and the delta rule's gradients of k and g, the most loads),
    and the Diagonal gain's split over T (the chunk maps and adjoints, the carry passes): no
    spill to local memory, which in these bandwidth-bound kernels would add traffic."""
    from deltalab.ops.kdn import triton_carry, triton_diag_gain, triton_iso_terms

    diag = triton_diag_gain
    kernels = []
    for which, kernel, n_pointers, flags in (
        ("forward", diag._kdn_diag_gain_token_forward_kernel, 8, {}),
        ("backward", diag._kdn_diag_gain_token_backward_kernel, 18,
         {"HAS_DP": True, "HAS_DK_IN": True, "HAS_DG_IN": True}),
        ("chunk_maps", diag._kdn_diag_gain_token_maps_kernel, 5, {}),
        ("chunk_adjoints", diag._kdn_diag_gain_token_adjoints_kernel, 11, {"HAS_DP": True}),
    ):  # fmt: skip
        block_t, block_k, warps = diag.launch(key_dim, 4096, which)
        constants = {**flags, "G_HEAD": g_head, "BLOCK_T": block_t, "BLOCK_K": block_k}
        kernels.append((kernel, n_pointers, constants, warps))
    block_p, block_c = triton_carry.carry_block(4096 // 32)
    carry = {"BLOCK_P": block_p, "BLOCK_C": block_c}
    kernels += [
        (triton_carry._kdn_carry_starts_kernel, 3, carry, triton_carry.CARRY_WARPS),
        (triton_carry._kdn_carry_ends_kernel, 2, carry, triton_carry.CARRY_WARPS),
    ]
    block_r, block_k, warps = triton_iso_terms.iso_launch(key_dim)
    iso = {"G_HEAD": g_head, "BLOCK_R": block_r, "BLOCK_K": block_k}
    routed = {**iso, "HAS_DK_IN": True, "HAS_DG_IN": True}  # the delta rule's gradients added
    kernels += [
        (triton_iso_terms._kdn_iso_terms_forward_kernel, 4, iso, warps),
        (triton_iso_terms._kdn_iso_terms_backward_kernel, 8, routed, warps),
    ]
    for kernel, n_pointers, constants, warps in kernels:
        _assert_compiles_without_spills(
            kernel, n_pointers, constants, warps, what=f"{kernel.fn.__name__} K={key_dim}"
        )


@pytest.mark.parametrize(
    ("lanes", "iso"),
    [(64, True), (8192, False), (16, True)],
    ids=["isotropic-B4H16", "diagonal-B4H16K128", "isotropic-B1H16"],
)
def test_kdn_variance_scan_kernels_compile_for_hopper_without_spills(lanes, iso):
    """The variance scan both ways at its T = 4096 launches, split over T (the chunks' maps and
    adjoints, the walks from their carries): Isotropic (its evidence and beta formed inside,
    bf16 q_noise and r, every output's gradient present) and the plain scan."""
    from deltalab.ops.kdn import triton as scan
    from deltalab.ops.mobius.triton import launch_config

    sixteen = {"NOISE": "*bf16", "R": "*bf16", "GNOISE": "*bf16", "GR": "*bf16"} if iso else {}
    grads = {"HAS_GP": True, "HAS_G2": True, "HAS_G3": iso}
    for kernel, n_pointers, tile, flags in (
        (scan._kdn_forward_kernel, 8, 2048, {}),
        (scan._kdn_chunk_maps_kernel, 5, 2048, {}),
        (scan._kdn_chunk_adjoints_kernel, 10, 1024, grads),
        (scan._kdn_backward_kernel, 15, 1024, {**grads, "SPLIT": True}),
    ):
        block_t, block_l = launch_config(lanes, 4096, tile=tile)
        constants = {**flags, "ISO": iso, "BLOCK_T": block_t, "BLOCK_L": block_l}
        _assert_compiles_without_spills(
            kernel, n_pointers, constants, 4, sixteen, what=f"{kernel.fn.__name__} {lanes} lanes"
        )


@pytest.mark.parametrize(
    ("width", "dtype"),
    [(2400, "bf16"), (3232, "bf16"), (3232, "fp32"), (37, "fp32")],
    ids=["340M-gdn2-bf16", "340M-transformer-bf16", "340M-fp32", "odd"],
)
def test_swiglu_kernels_compile_for_hopper_without_spills(width, dtype):
    """At the launches `swiglu` uses for the 340M FFNs (F = 2400 GDN-2, 3232 Transformer;
    bfloat16 under autocast) and a narrow odd F: no spill to local memory."""
    from deltalab.ops.swiglu import triton as swiglu

    activations = {name: f"*{dtype}" for name in ("GU", "H", "DH", "DGU")}
    kernels = [(swiglu._swiglu_fwd, "forward", 2), (swiglu._swiglu_bwd, "backward", 3)]
    for kernel, name, n_pointers in kernels:
        block_m, block_f, warps = swiglu.launch(1 << 14, width, name)
        constants = {"BM": block_m, "BF": block_f}
        _assert_compiles_without_spills(
            kernel, n_pointers, constants, warps, activations, what=f"{name} F={width} {dtype}"
        )


@pytest.mark.parametrize(
    ("width", "dtype"),
    [(1024, "bf16"), (8, "bf16"), (1024, "fp32"), (21, "fp32")],
    ids=["channel-bf16", "scalar-bf16", "channel-fp32", "odd"],
)
def test_log_decay_kernels_compile_for_hopper_without_spills(width, dtype):
    """At the launches the log decay uses for 340M shapes (raw [4, 4096, 8, 128] channel decay,
    [4, 4096, 8] scalar decay, bfloat16 under autocast): no spill to local memory."""
    from deltalab.ops.log_decay import triton as decay

    activations = {"RAW": f"*{dtype}", "DRAW": f"*{dtype}"}
    kernels = [
        (decay._log_decay_fwd, "forward", 4, {}),
        (
            decay._log_decay_bwd,
            "backward",
            7,
            {"WANT_DRAW": True, "WANT_DA": True, "WANT_DB": True},
        ),
    ]
    for kernel, name, n_pointers, constants in kernels:
        plan = decay.launch(4 * 4096, width, name)
        constants, warps = {**constants, "BM": plan.block_m, "BN": plan.block_n}, plan.warps
        compiled = _assert_compiles_without_spills(
            kernel, n_pointers, constants, warps, activations, what=f"{name} N={width} {dtype}"
        )
        if name == "forward":
            # softplus's log is libdevice's accurate logf, not lg2.approx (log1p relies on it).
            assert "lg2.approx" not in compiled.asm["ptx"]


@pytest.mark.parametrize(
    ("width", "dtype", "has_raw", "sigmoid"),
    [
        (1024, "bf16", True, False),
        (1024, "bf16", False, False),
        (1024, "fp32", True, False),
        (21, "fp32", True, False),
        (1024, "bf16", True, True),
    ],
    ids=["dynamic-bf16", "static-bf16", "dynamic-fp32", "odd", "sigmoid-gate-bf16"],
)
def test_read_gate_kernels_compile_for_hopper_without_spills(width, dtype, has_raw, sigmoid):
    """At the launches Muir's read gate uses for 340M shapes (q and raw [4, 4096, 8, 128],
    bfloat16 under autocast; "dynamic" and "static"), and GDN-2's gate products at the same
    shapes (`sigmoid_gate`: no read vector, no d read_log): no spill to local memory."""
    from deltalab.ops.read_gate import triton as read

    activations = {p: f"*{dtype}" for p in ("Q", "RAW", "OUT", "DOUT", "DQ", "DRAW")}
    kernels = [
        (read._read_gate_fwd, "forward", 5, {"HAS_RAW": has_raw, "SIGMOID": sigmoid}),
        (
            read._read_gate_bwd,
            "backward",
            8,
            {
                "HAS_RAW": has_raw,
                "WANT_DQ": True,
                "WANT_DRAW": has_raw,
                "WANT_DR": not sigmoid,
                "SIGMOID": sigmoid,
            },
        ),
    ]
    for kernel, name, n_pointers, constants in kernels:
        plan = read.launch(4 * 4096, width, name)
        constants, warps = {**constants, "BM": plan.block_m, "BN": plan.block_n}, plan.warps
        _assert_compiles_without_spills(
            kernel, n_pointers, constants, warps, activations, what=f"{name} N={width} {dtype}"
        )


@pytest.mark.parametrize(
    ("heads", "dim", "dtype"),
    [(8, 128, "bf16"), (8, 128, "fp32"), (3, 48, "fp32")],
    ids=["340M-bf16", "340M-fp32", "odd"],
)
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "backward"])
def test_rope_kernel_compiles_for_hopper_without_spills(heads, dim, dtype, inverse):
    """At the launches `rope` uses for the 340M Transformer's queries and keys (x [4, 4096, 8,
    128], bfloat16 under autocast) and an odd shape: no spill to local memory, and cos and sin
    are libdevice's accurate ones (with their range reduction), not cos.approx / sin.approx."""
    from deltalab.ops.rope import triton as rope

    kernel = rope._rope_kernel
    block_t, block_h, block_d, warps = rope.launch(4 * 4096, heads, dim // 2)
    constants = {"INVERSE": inverse, "BT": block_t, "BH": block_h, "BD": block_d}
    pointers = kernel.arg_names[:4]
    scalars = [a for a in kernel.arg_names[4:] if a not in constants]
    types = {"X": f"*{dtype}", "POS": "*i64", "Y": f"*{dtype}"}
    compiled = _compile_for_hopper(
        kernel, pointers, scalars, constants, {"num_warps": warps}, types, aligned=pointers
    )
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
    ptx = compiled.asm["ptx"]
    assert "cos.approx" not in ptx and "sin.approx" not in ptx
    # __nv_cosf / __nv_sinf keep the table of their Payne-Hanek range reduction (|theta| >
    # 105615) in local memory: 28 bytes, a 32-byte stack frame; anything beyond is a spill.
    assert re.findall(r"__local_depot\d+\[(\d+)\]", ptx) == ["28"]
    _assert_spills_within(compiled, 32, f"K={dim} {dtype}")


# The fused decoding step's pointers (`fused_step._fused_step_kernel`) held in float32: the state,
# the KDN precision (Exact KDN's covariance) and Exact KDN's P_bar k; the rest come in the
# model's dtype.
FUSED_STEP_FLOAT32 = ("MEMORY", "PRECISION", "PREDICTED", "COVARIANCE")
# Bytes a thread of the fused step may spill at a 128 x 128 head where the sizes are not declared
# multiples of 16 (one block of 16 warps, `table_launch`'s fallback): 0 to 56 by the form, Exact
# KDN 288 (measured). Where they are, every form spills nothing at the table's blocks (64 columns
# over 4 warps, 32 over 2).
FUSED_STEP_STACK = {"kdn_exact": 320}
FUSED_STEP_STACK_DEFAULT = 64


def _fused_step_signature(kernel, constants: dict) -> dict:
    """A fused-step kernel's Triton signature: its upper-case arguments pointers (float32 the
    FUSED_STEP_FLOAT32 ones, else bf16), the eps and noise floats fp32, other scalars i32."""
    floats = ("scale", "l2_eps", "norm_eps", "r_min", "info_scale")
    pointers = [a for a in kernel.arg_names if a.isupper() and a not in constants]
    pointers = [p for p in pointers if p not in ("H", "K", "V")]
    return {
        a: "constexpr"
        if a in constants
        else ("*fp32" if a in FUSED_STEP_FLOAT32 else "*bf16")
        if a in pointers
        else ("fp32" if a in floats else "i32")
        for a in kernel.arg_names
    }


@pytest.mark.parametrize(
    ("decay", "rule", "read", "tied"),
    [
        ("head", "beta", "none", False),
        ("channel", "erase_write", "dynamic", False),
        ("channel", "kdn_iso", "none", True),
        ("channel", "kdn_diag", "dynamic", False),
        ("channel", "kdn_exact", "none", False),
    ],
    ids=["gdn", "muir", "kdn_iso-tied", "kdn_muir", "kdn_exact"],
)
@pytest.mark.parametrize("sizes", ["multiples_of_16", "any"])
@pytest.mark.parametrize("programs", ["few", "many"])
def test_fused_decode_step_compiles_for_hopper_within_its_spills(
    decay, rule, read, tied, sizes, programs
):
    """At the launches `table_launch` gives the 340M presets' heads (K = V = 128) in bfloat16
    by the default table, below and from its `many_programs`: within shared memory, no bytes
    spilled where the sizes are multiples of 16 and at most FUSED_STEP_STACK's where they are
    not. Both variants Triton's launcher compiles: K, V and the row strides declared multiples
    of 16 (as it declares them at the 340M shapes; the table's launches), and declared nothing
    (the variant for other sizes; one block of 16 warps)."""
    from deltalab.ops.delta_rule.triton import fused_step as fs
    from deltalab.ops.norms.triton import GATES

    kernel = fs._fused_step_kernel
    value_dim = 128
    count = 1 if programs == "few" else fs.LAUNCH.many_programs
    aligned = sizes == "multiples_of_16"
    block_k, block_v, warps = fs.table_launch(fs.LAUNCH, count, 128, value_dim, aligned)
    constants = {
        "W": 4, "BW": 4, "BK": block_k, "BV": block_v, "DECAY": fs.DECAYS.index(decay),
        "RULE": fs.RULES.index(rule), "READ_FORM": fs.READS.index(read), "TIED": tied,
        "GATE_ACT": GATES["sigmoid"], "ONE_BLOCK": block_v >= value_dim,
        "BR": fs.COVARIANCE_ROWS, "DEPENDENT": False,
    }  # fmt: skip
    signature = _fused_step_signature(kernel, constants)
    pointers = [a for a, kind in signature.items() if kind.startswith("*")]
    sized = ["K", "V", *(a for a in kernel.arg_names if a.startswith("stride_"))]
    aligned = pointers + (sized if sizes == "multiples_of_16" else [])
    compiled = _compile_signature(kernel, signature, constants, {"num_warps": warps}, aligned)
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
    # At the 340M shapes no form spills (Exact KDN's covariance rows included).
    bound = (
        0 if sizes == "multiples_of_16" else FUSED_STEP_STACK.get(rule, FUSED_STEP_STACK_DEFAULT)
    )
    _assert_spills_within(compiled, bound, f"{rule}, {sizes}")


@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("tied", [False, True], ids=["free", "tied"])
@pytest.mark.parametrize("warps", [2, 4])
def test_exact_kdn_predict_kernel_compiles_for_hopper_without_spills(decay, tied, warps):
    """Exact KDN's first stage (`_exact_predict_kernel`, P_bar k over blocks of the covariance's
    rows) at a 340M head (K = 128, bf16 inputs) and the table's warps: no bytes spilled."""
    from deltalab.ops.delta_rule.triton import fused_step as fs

    kernel = fs._exact_predict_kernel
    constants = {"W": 4, "BW": 4, "BK": 128, "BR": fs.COVARIANCE_ROWS,
                 "DECAY": fs.DECAYS.index(decay), "TIED": tied, "DEPENDENT": False}  # fmt: skip
    signature = _fused_step_signature(kernel, constants)
    pointers = [a for a, kind in signature.items() if kind.startswith("*")]
    sized = ["K", *(a for a in kernel.arg_names if a.startswith("stride_"))]
    compiled = _compile_signature(kernel, signature, constants, {"num_warps": warps},
                                  pointers + sized)  # fmt: skip
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
    _assert_spills_within(compiled, 0, f"{decay}, {tied}, {warps} warps")


def _assert_waits_before_any_access(compiled, what: str) -> None:
    """A kernel compiled for dependent launch (`deltalab.ops._triton.dependent_launch`) waits
    for the kernel ahead of it before its first global load or store, and lets the next start."""
    ptx = compiled.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx, what
    memory = ("ld.global", "st.global", "atom.global", "red.global", "cp.async", "prefetch.global")
    accesses = [i for op in memory if (i := ptx.find(op)) >= 0]
    assert accesses and wait < min(accesses), f"{what}: a global access before the wait"


@pytest.mark.parametrize(
    ("bias", "residual"), [(False, False), (True, False), (False, True), (True, True)]
)
@pytest.mark.parametrize("width", [1024, 2400])
@pytest.mark.parametrize("given", ["x", "norm", "swiglu"])
def test_row_linear_compiles_for_hopper_without_spills(bias, residual, width, given):
    """`row_linear`'s kernel at its launch for a 340M layer's products (bf16; K = 1024: blocks of
    512, K = 2400: of 1024), with and without a bias, a residual, the norm of x or SwiGLU's
    gating of it: no bytes spilled, within shared memory."""
    from deltalab.ops.row_linear import triton as rl

    kernel = rl._row_linear_kernel
    constants = {"HAS_BIAS": bias, "HAS_RESIDUAL": residual, "HAS_NORM": given == "norm",
                 "SWIGLU": given == "swiglu", "BN": rl.BLOCK_N, "BK": rl.block_k(width),
                 "STAGES": rl.NUM_STAGES, "DEPENDENT": False}  # fmt: skip
    compiled = _compile_row_linear(kernel, constants, {"num_warps": rl.NUM_WARPS})
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
    _assert_spills_within(compiled, 0, f"row_linear K={width} bias={bias} residual={residual} "
                          f"{given}")  # fmt: skip


def _compile_row_linear(kernel, constants: dict, options: dict):
    """`row_linear`'s kernel for sm_90 in bf16, the pointers its flags leave unread None."""
    constants = dict(constants)
    for flag, pointer in (("HAS_BIAS", "B"), ("HAS_RESIDUAL", "R"), ("HAS_NORM", "NORM_W")):
        if not constants[flag]:
            constants[pointer] = None
    tensors = ("X", "W", "B", "R", "NORM_W", "Y")
    signature = {a: "constexpr" if a in constants else "*bf16" if a in tensors
                 else "fp32" if a == "norm_eps" else "i32" for a in kernel.arg_names}  # fmt: skip
    pointers = [a for a in tensors if a not in constants]
    return _compile_signature(kernel, signature, constants, options,
                              [*pointers, "K", "stride_x", "stride_y"])  # fmt: skip


@pytest.mark.skipif(
    not _triton.TRITON_HAS_DEPENDENT_LAUNCH,
    reason="dependent launch needs Triton 3.5 or later",
)
@pytest.mark.parametrize("given", ["x", "norm", "swiglu"])
def test_the_decoding_kernels_launched_dependent_wait_before_any_access(given):
    """With DEPENDENT (programmatic dependent launch), `row_linear`'s kernel and the fused
    step's two read and write nothing before `gdc_wait`: the kernel ahead of them may still be
    writing their inputs."""
    from deltalab.ops.delta_rule.triton import fused_step as fs
    from deltalab.ops.norms.triton import GATES
    from deltalab.ops.row_linear import triton as rl

    constants = {"HAS_BIAS": False, "HAS_RESIDUAL": True, "HAS_NORM": given == "norm",
                 "SWIGLU": given == "swiglu", "BN": rl.BLOCK_N, "BK": 512,
                 "STAGES": rl.NUM_STAGES, "DEPENDENT": True}  # fmt: skip
    options = {"num_warps": rl.NUM_WARPS, "launch_pdl": True}
    compiled = _compile_row_linear(rl._row_linear_kernel, constants, options)
    _assert_waits_before_any_access(compiled, f"row_linear, {given}")
    step = {"W": 4, "BW": 4, "BK": 128, "BV": 64, "DECAY": 2, "RULE": fs.RULES.index("kdn_exact"),
            "READ_FORM": 0, "TIED": False, "GATE_ACT": GATES["sigmoid"], "ONE_BLOCK": False,
            "BR": fs.COVARIANCE_ROWS, "DEPENDENT": True}  # fmt: skip
    predict = {k: step[k] for k in ("W", "BW", "BK", "BR", "DECAY", "TIED", "DEPENDENT")}
    for kernel, constants in ((fs._fused_step_kernel, step), (fs._exact_predict_kernel, predict)):
        signature = _fused_step_signature(kernel, constants)
        compiled = _compile_signature(kernel, signature, constants, options, [])
        _assert_waits_before_any_access(compiled, kernel.fn.__name__)
