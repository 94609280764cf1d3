"""The optimizer deltalab train builds (deltalab/train/optim.py): no-decay marks that survive
FSDP's parameter replacement, AdamW fused only where every parameter is a plain CUDA tensor, the
fused step moving the parameters as the default step does, and a state saved by the default step
resuming on the fused one."""

from __future__ import annotations

import torch


def test_no_decay_marks_survive_parameter_replacement_as_fsdp_does():
    from deltalab.models import CausalLM, build_config
    from deltalab.train.optim import no_decay_names, parameter_groups

    model = CausalLM(build_config("tiny", mixer="muir", num_layers=1))
    exempt = no_decay_names(model)
    assert any(name.endswith("dt_bias") for name in exempt)
    # FSDP2 swaps every parameter for a new one, dropping Python attributes such as the marks.
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().clone()))
    decay, no_decay = parameter_groups(model, 0.1, exempt)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == exempt
    assert all(p.dim() >= 2 for p in decay["params"])


def test_adamw_is_fused_only_when_every_parameter_is_a_plain_cuda_tensor(monkeypatch):
    from types import SimpleNamespace

    from deltalab.models import CausalLM, build_config
    from deltalab.train.config import OptimSection
    from deltalab.train.optim import build_optimizer, fused_adamw_applies

    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    cpu = torch.zeros(2)
    assert fused_adamw_applies([cuda, cuda])
    assert not fused_adamw_applies([cuda, cpu])
    assert not fused_adamw_applies([])
    # FSDP2's sharded parameters (DTensors) keep the default step.
    import torch.distributed.tensor as dtensor

    class Sharded:
        device = torch.device("cuda", 0)

    monkeypatch.setattr(dtensor, "DTensor", Sharded)
    assert not fused_adamw_applies([cuda, Sharded()])
    assert fused_adamw_applies([cuda, cuda])
    # On CPU the optimizer keeps torch's default step, so CPU results do not move.
    model = CausalLM(build_config("tiny", mixer="gdn2", num_layers=1))
    assert build_optimizer(model, OptimSection(lr=1e-3)).defaults["fused"] is None


def test_fused_adamw_as_built_steps_as_the_default_step(generator):
    """The fused AdamW `build_optimizer` takes on CUDA, asked for here on CPU (torch has the
    fused step there too): its groups and settings move the parameters as the default step
    does (test_cuda.py runs the same on the GPU)."""
    from conftest import built_and_default_adamw_steps

    from deltalab.models import CausalLM, build_config

    model = CausalLM(build_config("tiny", mixer="gdn2", num_layers=1))
    built, params = built_and_default_adamw_steps(model, generator, fused=True)
    assert built.defaults["fused"] is True
    for name, p, q in params:
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_state_saved_by_the_default_step_resumes_on_the_fused_step(generator):
    """A checkpoint written by AdamW's default step (a CPU run, or one before AdamW was fused on
    CUDA), loaded into the fused AdamW `build_optimizer` makes on CUDA (asked for on CPU here):
    the fused step stays, the moments come back, and it steps."""
    from deltalab.models import CausalLM, build_config
    from deltalab.train import optim
    from deltalab.train.config import OptimSection

    model = CausalLM(build_config("tiny", mixer="gdn2", num_layers=1))
    default = optim.build_optimizer(model, OptimSection(lr=1e-3))
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    default.step()
    saved = default.state_dict()
    assert saved["param_groups"][0]["fused"] is None
    fused = optim.build_optimizer(model, OptimSection(lr=1e-3), fused=True)
    fused.load_state_dict(optim.with_step_implementation(saved, fused))
    assert all(group["fused"] is True for group in fused.param_groups)
    first = next(iter(model.parameters()))
    torch.testing.assert_close(
        fused.state[first]["exp_avg"], default.state[first]["exp_avg"], rtol=0, atol=0
    )
    fused.step()
    # Without it the loaded groups would bring the default step back.
    again = optim.build_optimizer(model, OptimSection(lr=1e-3))
    again.load_state_dict(saved)
    assert again.param_groups[0]["fused"] is None
