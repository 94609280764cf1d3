"""GPU counterparts of the CPU tests: the same ops on CUDA against float64 references on CPU.

Skipped where no GPU is present (CI); everything checked here has a CPU test beside it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_delta_inputs

from deltalab.models import CausalLM, build_config
from deltalab.ops import delta_rule, kdn_diag, kdn_iso
from deltalab.testing import TOLERANCE, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
@pytest.mark.parametrize("chunk_size", [16, 64, 256])
@pytest.mark.parametrize("length", [1, 100, 257])
def test_cuda_chunk_float64_matches_cpu_naive(generator, length, chunk_size, channel_decay):
    inputs = random_delta_inputs(generator, 2, length, 3, 16, 8, channel_decay=channel_decay)
    o_ref, s_ref = delta_rule(*inputs, backend="naive", output_final_state=True)
    o, s = delta_rule(*(x.cuda() for x in inputs), chunk_size=chunk_size, output_final_state=True)
    assert relative_error(o.cpu(), o_ref) < TOLERANCE[torch.float64]
    assert relative_error(s.cpu(), s_ref) < TOLERANCE[torch.float64]


@pytest.mark.parametrize("channel_decay", [False, True], ids=["head_decay", "channel_decay"])
def test_cuda_float32_chunk_256_is_stable_under_strong_decay(generator, channel_decay):
    inputs = random_delta_inputs(
        generator, 1, 1024, 4, 64, 64, channel_decay=channel_decay, min_log_decay=-20.0
    )
    o_ref, _ = delta_rule(*inputs, backend="naive")
    o, _ = delta_rule(*(x.float().cuda() for x in inputs), chunk_size=256)
    assert torch.isfinite(o).all()
    assert relative_error(o.cpu(), o_ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("op", [kdn_iso, kdn_diag])
def test_cuda_kdn_matches_cpu(generator, op):
    B, T, H, K, V = 2, 130, 2, 16, 8
    q = torch.randn(B, T, H, K, generator=generator, dtype=torch.float64)
    k = torch.nn.functional.normalize(
        torch.randn(B, T, H, K, generator=generator, dtype=torch.float64), dim=-1
    )
    v = torch.randn(B, T, H, V, generator=generator, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)
    noise_shape = (B, T, H) if op is kdn_iso else (B, T, H, K)
    q_noise = torch.rand(*noise_shape, generator=generator, dtype=torch.float64) * 0.1
    r = torch.rand(B, T, H, generator=generator, dtype=torch.float64) + 0.1
    p0 = torch.ones(H) if op is kdn_iso else torch.ones(H, K)
    args = (q, k, v, g, q_noise, r, p0.double())
    o_ref, _ = op(*args, backend="naive")
    o, _ = op(*(x.cuda() for x in args))
    assert relative_error(o.cpu(), o_ref) < TOLERANCE[torch.float64]


@pytest.mark.parametrize("mixer", ["gdn2", "muir", "kdn_diag", "transformer"])
def test_cuda_model_decoding_equals_full_forward(generator, mixer):
    torch.manual_seed(0)
    config = build_config("tiny", mixer=mixer, chunk_size=16)
    model = CausalLM(config).cuda().eval()
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=generator).cuda()
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :25], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(25, 40):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    assert relative_error(torch.cat(logits, dim=1), full) < 1e-5
