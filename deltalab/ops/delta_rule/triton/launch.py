"""The Triton delta rule's launch table: `DeltaRuleLaunch`, the settings measured best (`LAUNCH`)
and the table per card (`LAUNCH_TABLES`). A module of its own, apart from the kernels it sets,
so that the state pass (`state_pass.py`) and the op's entry (`chunk.py`) both take it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltalab.ops.delta_rule.triton.factors import LAUNCH as FACTORS_LAUNCH
from deltalab.ops.delta_rule.triton.intra import LAUNCH as INTRA_LAUNCH
from deltalab.ops.delta_rule.triton.intra import TileLaunch
from deltalab.ops.delta_rule.triton.solve import LAUNCH as SOLVE_LAUNCH
from deltalab.ops.launch_tables import LaunchRegistry


@dataclass(frozen=True)
class DeltaRuleLaunch:
    """The Triton delta rule's launch table: the state pass's value columns, row blocks, warps
    and pipeline stages, the threshold between its fused and split forms, and the tables of
    the kernels of stages 1-2 (`TileLaunch`: the factors, stage 1, the solve). `LAUNCH` holds
    the settings measured best (below); `delta_rule_triton` and the stages' launch functions
    take another as an argument (`tune_triton.py` sweeps them; tests reach at tiny shapes the
    paths of large ones)."""

    # Value columns per program: S [K, BV] float32 stays in registers, and B * H * V / BV programs
    # fill the GPU's SMs (one sequence and head alone is sequential). Measured on the H200 at
    # K = 128 (benchmarks/tune_triton.py): 64 columns with 8 warps beat 32 with 4 (0.78 / 0.86 ms
    # forward / backward against 0.88 / 1.19: half the programs reload each chunk's operators);
    # K = 256 keeps 32.
    block_v: int = 64
    block_v_wide_k: int = 32
    # Rows of a chunk per tile: a 64 x 64 float32 tile of `attend` is 16 KiB; a whole 256 x 256
    # chunk is 256 KiB, past the 227 KiB of shared memory of an H100/H200 SM (measured: chunk 256
    # failed to compile as one tile).
    block_c: int = 64
    # Warps per program of the state pass (with block_v above; the narrow launch below takes its
    # own) and of the operator gradients.
    num_warps: int = 8
    # Pipeline stages of the fused walks' chunk loop, with 16-bit operators and K <= 128
    # (`state_pass._launch` takes 1 otherwise). Software pipelining keeps the next chunk's tiles
    # in shared memory while this one's products run: with float32 operators 2 stages
    # overflowed the SM's 227 KiB (2026-12-02). 16-bit operators
    # (`KernelOptions.operator_dtype`) halve the operator tiles;
    # compiled for sm_90 (Triton 3.9, BV 64, 8 warps), forward / backward at chunk 64 take 64 / 64
    # KiB with 1 stage, 64 / 128 with 2, 64 / 160 with 3 (chunk 128: 64 / 64, 84 / 80, 100 / 96;
    # tests/test_triton_compile.py checks 2 and 3 fit). With the products widened (`walk_dots`
    # "float32") it stays 1 at block_v: 2 stages at BV 64 were slower backward on the H200 (below),
    # and where the fused walks make enough programs the narrow launch below is faster than either;
    # 16-bit products take low_dots_num_stages instead.
    num_stages: int = 1
    # The fused walks with 16-bit operators (K <= 128) and widened products (with 16-bit products,
    # see low_dots_num_warps below): narrow_block_v columns, narrow_num_stages stages and
    # narrow_num_warps warps wherever that makes fused_pass_min_programs walks (else block_v's
    # launch or the split pass; narrow_block_v None: never). Half the columns double the walks, and
    # the pipeline hides the operator loads of each chunk behind the products of the one before.
    # Measured on the H200, B=4 T=4096 K=V=128, bf16 (`tune_triton.py --shape 4xTx{8,16}x128
    # --stages state_pass state_pass_split`, 2026-12-02), forward / backward ms per layer:
    #
    #                                                   H=8 (340M preset)   H=16
    #   fused, BV 64, 8 warps, 1 stage                  0.56 / 0.57         0.63 / 0.61
    #   fused, BV 64, 8 warps, 2 stages                 0.48 / 0.59         0.51 / 0.60
    #   fused, BV 32, 8 warps, 2 stages                 0.36 / 0.33         0.73 / 0.66
    #   fused, BV 32, 4 warps, 2 stages (this launch)   0.32 / 0.39         0.47 / 0.58
    #   split, its launch                               0.37 / 0.45         0.68 / 0.83
    #
    # At H=8 it replaced the split pass (0.82 -> 0.71 ms a layer: the 340M step's delta-rule kernels
    # 76.8 -> 74.4 ms), at H=16 the fused pass at block_v (1.24 -> 1.05). With one sequence of 16K
    # tokens at H=8 (32 walks even at 32 columns) the split pass stays. With the products widened to
    # float32 the forward walk spills registers at each of these launches (compiled for sm_90; the
    # figures at `state_pass.low_dots`, the choice that removes them).
    narrow_block_v: int | None = 32
    narrow_num_stages: int = 2
    narrow_num_warps: int = 4
    # With the walks' products in the operators' 16-bit dtype (`walk_dots` "operators", the default)
    # the operand registers halve and the order above changes: block_v's 64 columns on
    # low_dots_num_warps warps with low_dots_num_stages stages wherever they make
    # fused_pass_min_programs walks, else the narrow launch where its walks do, else the split pass.
    # Measured on the H200, B=4 T=4096 K=V=128, bf16, products in bf16 (`tune_triton.py --shape
    # 4x4096x{16,8}x128 --stages state_pass`, 2026-12-02), forward / backward ms per layer:
    #
    #                                                   H=8 (340M preset)   H=16
    #   fused, BV 64, 4 warps, 2 stages (this launch)   0.24 / 0.25         0.28 / 0.31
    #   fused, BV 64, 8 warps, 2 stages                 0.26 / 0.26         0.30 / 0.29
    #   fused, BV 32, 4 warps, 2 stages (narrow)        0.20 / 0.19         0.38 / 0.38
    #   (products widened to float32, the narrow launch 0.32 / 0.39         0.47 / 0.57)
    #
    # so H=16 takes this launch (128 walks) and H=8 at B=4 the narrow one (64 walks at 64 columns).
    low_dots_num_warps: int = 4
    low_dots_num_stages: int = 2
    # Value columns per step of the operator-gradient kernel: its [C, K] accumulators stay in
    # registers, the [K, BV] state blocks stream through.
    operator_block_v: int = 32
    # Pipeline stages of the split walks' chunk loop (forward and backward), at K <= 128 (K = 256
    # takes 1). The fused walks need 1 (2 overflowed shared memory); the split walks hold fewer
    # tiles per step, and 2 stages overlap the next chunk's loads with this one's products. Compiled
    # for sm_90 (tests/test_triton_compile.py's way, TF32, 8 warps, BV = 64): forward / backward
    # walk 80 / 80 KiB of shared memory with 1 stage, 208 / 192 KiB with 2 (the SM has 227), 288 /
    # 256 with 3; at K = 256, chunk 128 (BV = 32) 104 / 104 KiB with 1, 312 / 304 with 2 (too many).
    split_num_stages: int = 2
    # Value columns and warps per program of the split walks. The walk is latency-bound (one chunk
    # after another, a few small products each), so more programs of fewer columns win. Measured on
    # the H200 at the 340M preset's heads, H=8 K=V=128 chunk 64, bf16 inputs (benchmarks/
    # tune_triton.py --stages state_pass_split), forward / backward ms per layer:
    #
    #   walk setting (2 stages unless said)   B=4 T=4096     B=1 T=16384
    #   BV 16, 2 warps                         0.46 / 0.59    1.00 / 1.38
    #   BV 32, 4 warps                         0.49 / 0.56    1.40 / 1.56
    #   BV 64, 8 warps, 1 stage                0.66 / 0.76    2.06 / 2.33
    #   fused pass, its default (BV 64)        0.72 / 0.84    2.72 / 3.23
    #
    # (3 stages at BV 32 ran out of shared memory: 240 of 227 KiB.) K = 256 keeps block_v_wide_k.
    split_walk_block_v: int = 16
    split_walk_num_warps: int = 2
    # Value columns and warps per program of the split pass's parallel kernels (outputs forward, P
    # and Q backward): B * H * n * V / BV programs (times the row blocks forward), no registers
    # carried across chunks. Compiled for sm_90 at K = 128 and 256 (tests/test_triton_compile.py), 4
    # warps of 32 columns spill no registers (an earlier backward spilled 176 bytes a thread in its
    # Q [K, BV] at 4 warps of 64 columns; the current one does not). Measured on the H200 with bf16
    # operators (`tune_triton.py --stages state_pass_split`, 2026-12-02), the split pass forward /
    # backward ms per layer:
    #
    #   parallel kernels                B=4 T=4096 H=8   B=1 T=16384 H=8
    #   BV 64, 8 warps                  0.37 / 0.45      0.77 / 1.09
    #   BV 32, 4 warps                  0.33 / 0.43      0.71 / 1.07
    #   BV 128, 8 warps                 0.45 / 0.49      0.84 / 1.13
    split_block_v: int = 32
    split_num_warps: int = 4
    # The state pass `_DeltaRuleTriton` runs, `KernelOptions.state_pass`: "fused" (stages 3-4 in one
    # walk, `state_pass_triton`), "split" (the walk reduced to the state recurrence,
    # `state_pass_split_triton`), or "auto", the default: the fused pass from
    # fused_pass_min_programs programs (B * H * V / BV at the launch `state_pass._launch`
    # picks), the split pass below (96: a threshold between the two measured points, 64 and 128
    # programs, not itself measured). The backward takes the forward's form. Measured on the
    # H200 (`tune_triton.py`, per layer, forward / backward ms):
    #   B=4 T=4096 H=16 (128 fused programs): fused 0.78 / 0.86, split 0.91 / 1.25;
    #   B=4 T=4096 H=8 (64): fused 0.72 / 0.84, split 0.46 / 0.59;
    #   B=1 T=16384 H=8 (16): fused 2.72 / 3.23, split 1.00 / 1.38.
    # (Those with float32 operators; with 16-bit ones the fused pass's launches are counted as
    # `_launch` picks them: at B=4, BV 64 at H=16 and the narrow launch at H=8, see
    # low_dots_num_warps.) The split walk has 4x the programs of the fused one (16 value columns,
    # not 64) and leaves the outputs to kernels parallel over chunks: it wins while the fused walks
    # leave SMs idle (132 on the H200), and loses by its extra kernels and traffic once they do not.
    fused_pass_min_programs: int = 96
    # The kernels of stages 1-2.
    factors: TileLaunch = FACTORS_LAUNCH
    intra: TileLaunch = INTRA_LAUNCH
    solve: TileLaunch = SOLVE_LAUNCH


LAUNCH = DeltaRuleLaunch()
# The table per card (`deltalab.ops.launch_tables`): `delta_rule_triton` takes the one for its
# inputs' device when given none.
LAUNCH_TABLES = LaunchRegistry("delta_rule", LAUNCH)
