"""benchmarks/traffic.py: a training step's memory traffic by module, op and category."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import traffic
from deltalab.layers.norms import RMSNorm

# The count stubs every Triton launch, compiled or interpreted: README's test command runs these
# again under TRITON_INTERPRET=1, where kernels are the interpreter's functions.
pytestmark = pytest.mark.interpreter


@pytest.fixture(scope="module")
def gdn2_ops():
    """One fake-tensor step of a 2-layer tiny GDN-2."""
    return traffic.measure("gdn2", "tiny", batch=2, seq_len=32, num_layers=2)


def test_categories_add_up_to_the_total(gdn2_ops):
    summary = traffic.summarize(gdn2_ops, top=5, bandwidth=3e12)
    total = summary["total"]["gb"]
    assert total == pytest.approx(sum(o.bytes for o in gdn2_ops) / 1e9)
    assert sum(c["gb"] for c in summary["categories"].values()) == pytest.approx(total)
    assert sum(c["calls"] for c in summary["categories"].values()) == len(gdn2_ops)
    assert sum(r["gb"] for r in summary["glue_by_phase"]) == pytest.approx(
        summary["categories"][traffic.GLUE]["gb"]
    )
    for label in (traffic.GLUE, traffic.MATMUL, traffic.DELTA, traffic.OPTIMIZER):
        assert summary["categories"][label]["gb"] > 0, label


def test_matrix_products_and_kernels_are_not_glue(gdn2_ops):
    products = [o for o in gdn2_ops if o.op in ("mm", "addmm", "bmm")]
    assert products and all(o.category == traffic.MATMUL for o in products)
    glue = [o for o in gdn2_ops if o.category == traffic.GLUE]
    # Kernels in glue: only the norms', SwiGLU's, the log decay's and the read gate's
    # (deltalab.ops.norms, .swiglu, .log_decay, .read_gate), which replace glue ops; the decay
    # and the gate products (`sigmoid_gate`, the read gate's kernels) ran as kernels, both ways.
    kernels_in_glue = {o.op for o in glue if o.op.startswith("triton:")}
    decay = {"triton:_log_decay_fwd", "triton:_log_decay_bwd"}
    products = {"triton:_read_gate_fwd", "triton:_read_gate_bwd"}
    assert decay | products <= kernels_in_glue <= {
        "triton:_norm_fwd", "triton:_norm_bwd", "triton:_swiglu_fwd", "triton:_swiglu_bwd",
        *decay, *products,
    }  # fmt: skip
    assert not any(o.op in ("sigmoid", "sigmoid_backward") for o in glue)
    assert not any(o.op in traffic.MATMUL_OPS for o in glue)
    # The delta rule ran as the Triton kernels (stubs), both ways, not the PyTorch chunk path:
    # the state pass chosen for the tiny model's shape (B=2, H=2, K=V=64), its walks and its
    # parallel kernels, and not the other.
    from deltalab.ops.delta_rule.triton.state_pass import chosen_state_pass

    kernels = {o.op for o in gdn2_ops if o.category == traffic.DELTA}
    passes = {"split": {"_state_pass_split_fwd", "_state_pass_split_out",
                        "_state_pass_split_dout", "_state_pass_split_bwd"},
              "fused": {"_state_pass_fwd", "_state_pass_bwd"}}  # fmt: skip
    chosen = chosen_state_pass(2, 2, 64, 64)
    assert {f"triton:{k}" for k in passes[chosen]} <= kernels
    (other,) = set(passes) - {chosen}
    assert not {f"triton:{k}" for k in passes[other]} & kernels
    assert not any("delta_rule/chunk.py" in o.function for o in gdn2_ops)


def test_backward_ops_are_charged_to_the_forward_module(gdn2_ops):
    norm = [o for o in gdn2_ops if o.path == "model.blocks.*.mixer.o_norm"]
    assert {o.phase for o in norm} >= {"forward", "backward"}
    assert {o.module for o in norm} == {"GatedRMSNorm"}
    backward = [o for o in gdn2_ops if o.phase == "backward"]
    assert not [o for o in backward if o.path in ("(untagged)", "(top)") and o.bytes]
    # The weights' bf16 copies for the projections: CUDA autocast's casts, charged to Linear.
    casts = [o for o in gdn2_ops if o.module == "Linear" and o.op == "_to_copy"]
    assert any(o.phase == "forward" and o.dtypes == "f32->bf16" for o in casts)


def test_an_rms_norm_moves_the_bytes_of_its_ops():
    rows, dim = 15, 16
    # The torch path's ops (recording would take the Triton kernels under "auto").
    model = nn.Sequential(nn.Identity(), RMSNorm(dim, backend="torch"))
    x = torch.randn(3, 5, dim, requires_grad=True)
    with traffic.recording(model) as recorder:
        model(x).sum().backward()
    forward = [
        o for o in recorder.ops if o.phase == "forward" and o.module == "RMSNorm" and o.bytes
    ]
    assert {o.path for o in forward} == {"1"}
    # pow, mean, + eps, rsqrt, * rstd, * weight over float32 [rows, dim] and rstd [rows, 1].
    assert [o.op for o in forward] == ["pow", "mean", "add", "rsqrt", "mul", "mul"]
    expected = 4 * (7 * rows * dim + 6 * rows + dim)
    assert sum(o.bytes for o in forward) == expected
    assert all(o.category == traffic.GLUE for o in forward)
    # Its backward: the Python backward of the autograd.Function, named by its own frame.
    backward = [o for o in recorder.ops if o.phase == "backward" and o.module == "RMSNorm"]
    moved = [o for o in backward if o.bytes]
    assert len(moved) == 9 and all("_RMSNormFunction" in o.function for o in moved)


def test_an_rms_norm_on_triton_is_one_glue_kernel_each_way():
    rows, dim = 15, 16
    model = nn.Sequential(nn.Identity(), RMSNorm(dim))
    x = torch.randn(3, 5, dim, requires_grad=True)
    with traffic.recording(model) as recorder:
        model(x).sum().backward()
    kernels = [o for o in recorder.ops if o.op.startswith("triton:") and o.module == "RMSNorm"]
    assert [(o.phase, o.op) for o in kernels] == [
        ("forward", "triton:_norm_fwd"), ("backward", "triton:_norm_bwd"),
    ]  # fmt: skip
    assert all(o.category == traffic.GLUE for o in kernels)
    # The forward reads x and the weight, writes y and 1/rms per row: no float32 intermediates.
    assert kernels[0].bytes == 4 * (2 * rows * dim + dim + rows)


def test_a_swiglu_on_triton_is_one_glue_kernel_each_way():
    """The FFN's gating: the forward kernel reads gate_up and writes h, the backward reads
    gate_up and dh and writes d(gate_up); no recomputed forward, no cat."""
    from deltalab.models.lm import SwiGLU

    rows, width = 15, 12
    model = nn.Sequential(nn.Identity(), SwiGLU(8, width))
    x = torch.randn(3, 5, 8, requires_grad=True)
    with traffic.recording(model) as recorder:
        model(x).sum().backward()
    ops = [o for o in recorder.ops if o.module == "SwiGLU" and o.bytes]
    assert [(o.phase, o.op) for o in ops] == [
        ("forward", "triton:_swiglu_fwd"), ("backward", "triton:_swiglu_bwd"),
    ]  # fmt: skip
    assert all(o.category == traffic.GLUE for o in ops)
    assert [o.bytes for o in ops] == [4 * 3 * rows * width, 4 * 5 * rows * width]


def test_bytes_count_broadcasts_once_and_in_place_destinations_once():
    model = nn.Identity()
    a, b = torch.zeros(8, 4), torch.ones(4)
    with traffic.recording(model) as recorder:
        a.add_(b.expand(8, 4))  # reads a and one row, writes a
        a.copy_(b.expand(8, 4))  # a copy does not read its destination
        a.t().contiguous()  # the view is free, the copy is not
    views = [o for o in recorder.ops if o.op in ("expand", "t")]
    assert len(views) == 3 and not any(o.bytes for o in views)
    add, copy, clone = (o for o in recorder.ops if o not in views)
    assert (add.op, add.read, add.written) == ("add_", 4 * (32 + 4), 4 * 32)
    assert (copy.op, copy.read, copy.written) == ("copy_", 4 * 4, 4 * 32)
    assert (clone.op, clone.read, clone.written) == ("clone", 4 * 32, 4 * 32)


def test_cpu_autocast_gets_cuda_lists_only_while_measuring():
    x = torch.randn(4, 8).to(torch.bfloat16)
    target = torch.zeros(4, dtype=torch.long)
    with traffic.recording(nn.Identity()) as recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.exp(x).dtype == torch.float32  # CUDA: fp32 list (CPU: bf16)
            assert x.sum().dtype == torch.float32  # CUDA: float32 through dtype=
            F.cross_entropy(x, target)
    # cross_entropy is not cast as a whole (CPU's list casts it): its log_softmax runs in the
    # logits' dtype (it passes that dtype), then nll_loss (fp32 list) casts.
    ops = [(o.op, o.dtypes) for o in recorder.ops]
    start = ops.index(("_log_softmax", "bf16->bf16"))
    assert ops[start + 1 :] == [("_to_copy", "bf16->f32"), ("nll_loss_forward", "f32,i64->f32")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.exp(x).dtype == torch.bfloat16  # CPU's own lists again


def test_value_checks_are_counted_as_host_reads_of_no_bytes(gdn2_ops):
    """Every value read back to the host (a check's answer) is one op of the host-read
    category, moving no bytes. A step reads twice, as the trainer's: the token ids (before the
    embedding) and, once at the forward's end, every layer's queued checks (the delta rule's
    g <= 0 among them: none is read on its own)."""
    reads = [o for o in gdn2_ops if o.category == traffic.HOST_READ]
    assert reads and all(o.op == "_local_scalar_dense" for o in reads)
    assert all(o.phase != "optimizer" for o in reads)  # AdamW's step counts stay on the host
    assert sum(o.bytes for o in reads) == 0
    assert not any(
        o.op == "_local_scalar_dense" for o in gdn2_ops if o.category != traffic.HOST_READ
    )
    summary = traffic.summarize(gdn2_ops, top=50, bandwidth=3e12)
    assert summary["categories"][traffic.HOST_READ]["calls"] == len(reads)
    functions = {r["key"][0]: r["calls"] for r in summary["host_reads_by_function"]}
    assert functions == {"models/lm.py:check_token_ids": 1, "ops/_checks.py:one_host_read": 1}
