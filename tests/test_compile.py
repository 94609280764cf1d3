"""Models under `torch.compile` (`train.compile=true`): the same loss and gradients as eager.

Dynamo must not trace into the Triton launches (`deltalab.ops._triton.opaque_to_compiler`):
their tile sizes and warps are compile-time constants, which it fails on once a shape is
symbolic, and under the interpreter it would trace the interpreter itself. Before that guard,
compiling a model on the Triton backend failed here (under `TRITON_INTERPRET=1`) and on an H200.

The compiler backend is "aot_eager": Dynamo's graph capture and AOTAutograd's joint graph, where
the failures were, without Inductor's C++ build (minutes on CPU; what Inductor generates is
torch's own, tested there). The Triton tests run on a CUDA GPU or on CPU under the interpreter
(README's test command runs this file a second time with it set); skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from deltalab.models import CausalLM, build_config
from deltalab.ops._triton import INTERPRET, triton_unavailable_reason
from deltalab.testing import assert_close

pytestmark = pytest.mark.interpreter

CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = triton_unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
# Relative error: compiled and eager run the same float32 ops; capture may reorder sums only.
F32 = 1e-5
# One layer of narrow heads (K = V = 16) and chunks of 16: 24 tokens make two chunks, a partial
# one among them, and every kernel the tiny preset's layer launches runs (the interpreter runs
# each in Python, in time growing with its tiles).
SIZES = dict(num_layers=1, hidden_size=32, head_dim=16, chunk_size=16)


def _loss_and_grads(model: CausalLM, forward, ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = forward(ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _compiled_matches_eager(
    mixer: str, backend: str, device: str, recompute_ffn: bool = False
) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    config = build_config("tiny", mixer=mixer, backend=backend, **SIZES)
    model = CausalLM(config).to(device)
    model.model.recompute_ffn = recompute_ffn  # as the trainer sets train.recompute_ffn
    ids = torch.randint(0, config.vocab_size, (2, 24), device=device)
    loss, grads = _loss_and_grads(model, model, ids)
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):  # the second call runs the cached graphs
        loss_c, grads_c = _loss_and_grads(model, compiled, ids)
        assert_close(loss_c, loss, F32, f"{mixer} loss")
        assert grads_c.keys() == grads.keys()
        for name, grad in grads.items():
            assert_close(grads_c[name], grad, F32, f"{mixer} d{name}")


@needs_triton
@pytest.mark.parametrize("mixer", ["muir", "kdn_diag", "transformer"])
def test_compiled_model_on_triton_kernels_matches_eager(mixer):
    # muir: the norms, short convolutions, log decay, delta rule, SwiGLU and read gate kernels
    # (every launch GDN-2's layer makes, and its read query; GDN-2's own code is compiled on the
    # chunk path below); kdn_diag: the variance scan and the fused gain; transformer: RoPE.
    _compiled_matches_eager(mixer, "triton", DEVICE)


@needs_triton
def test_compiled_model_with_its_ffn_recomputed_matches_eager():
    # The recomputed FFN branch (a checkpoint around the norm and SwiGLU kernels) traced; the
    # Transformer's blocks, whose FFN branch is every model's (GDN-2's takes the interpreter
    # 50 s more).
    _compiled_matches_eager("transformer", "triton", DEVICE, recompute_ffn=True)


@pytest.mark.skipif(INTERPRET, reason="the torch path: run without the interpreter")
@pytest.mark.parametrize("recompute_ffn", [False, True], ids=["", "ffn-recomputed"])
def test_compiled_model_on_the_chunk_path_matches_eager(recompute_ffn):
    _compiled_matches_eager("gdn2", "chunk", "cpu", recompute_ffn)


@needs_triton
def test_triton_launches_are_opaque_to_dynamo():
    # Each public Triton entry point of the layers is wrapped: Dynamo skips it.
    from deltalab.ops.delta_rule.triton.chunk import delta_rule_triton
    from deltalab.ops.delta_rule.triton.step import delta_rule_step_triton
    from deltalab.ops.kdn.triton import kdn_iso_scan, kdn_variance_scan
    from deltalab.ops.kdn.triton_diag_gain import kdn_diag_gain
    from deltalab.ops.kdn.triton_iso_terms import kdn_iso_gain
    from deltalab.ops.log_decay.triton import log_decay_triton
    from deltalab.ops.mobius.triton import mobius_scan_lanes, mobius_scan_triton
    from deltalab.ops.norms.triton import l2_normalize_triton, rms_norm_triton
    from deltalab.ops.read_gate.triton import read_query_triton, sigmoid_gate_triton
    from deltalab.ops.rope.triton import rope_triton, rotate
    from deltalab.ops.short_conv.triton import short_conv_triton
    from deltalab.ops.swiglu.triton import swiglu_triton

    entry_points = (
        delta_rule_triton, kdn_variance_scan, kdn_iso_scan, kdn_diag_gain, kdn_iso_gain,
        log_decay_triton,
        mobius_scan_lanes, mobius_scan_triton, l2_normalize_triton, rms_norm_triton,
        read_query_triton, sigmoid_gate_triton, rope_triton, rotate, short_conv_triton,
        swiglu_triton, delta_rule_step_triton,
    )  # fmt: skip
    for fn in entry_points:
        assert getattr(fn, "_torchdynamo_disable", False), fn.__qualname__
