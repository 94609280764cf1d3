"""Writes the behaviour fixture of tests/test_refactor_fixture.py: run it only to record a new
reference, from code whose behaviour is the one to keep (it was run before issue 12's refactors,
and again when the FFN's initialization changed: tests/test_refactor_fixture.py).

For every variant (each mixer kind, plus options that change a mixer's code path): a tiny
`save_pretrained` directory under `refactor_fixture/<name>/` (config.json and the weights the
seed gave), and in `refactor_fixture/reference.pt` the logits on fixed tokens (whole sequence,
left-padded batch, prefill then token by token) and the parameters after one AdamW step.

    PYTHONPATH=$PWD python tests/data/make_refactor_fixture.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import deltalab.models  # noqa: F401  (registers the model with transformers' Auto classes)
from deltalab.models import CausalLM, DeltaLabConfig

HERE = Path(__file__).parent / "refactor_fixture"
SEED = 0
SIZES = dict(
    hidden_size=16,
    num_layers=1,
    num_heads=2,
    head_dim=8,
    vocab_size=16,
    ffn_width=16,
    chunk_size=16,
)
# name -> config fields beyond SIZES. Besides every mixer kind: the mixer options that select
# another code path (output-gate rank and activation, Muir's read gates, KDN's tied noise) and
# a hybrid layout with attention.
VARIANTS = {
    "deltanet": dict(mixer="deltanet"),
    "deltanet_lowrank_sigmoid": dict(
        mixer="deltanet", mixer_options={"gate_rank": 4, "gate_activation": "sigmoid"}
    ),
    "gdn": dict(mixer="gdn"),
    "kda": dict(mixer="kda", value_dim=4),
    "gdn2": dict(mixer="gdn2"),
    "gdn2_hybrid": dict(mixer="gdn2", num_layers=2, attention_every=2),
    "muir": dict(mixer="muir"),
    "muir_static": dict(mixer="muir", mixer_options={"read_gate": "static"}),
    "muir_none_fullrank": dict(
        mixer="muir",
        mixer_options={
            "read_gate": "none",
            "ranks": {"decay": 4, "erase": None, "write": None, "read": None, "outgate": None},
        },
    ),
    "kdn_iso": dict(mixer="kdn_iso"),
    "kdn_iso_tied": dict(mixer="kdn_iso", mixer_options={"process_noise": "tied"}),
    "kdn_diag": dict(mixer="kdn_diag", mixer_options={"info_scale": 2.0}),
    "kdn_diag_tied": dict(mixer="kdn_diag", mixer_options={"process_noise": "tied"}),
    "kdn_exact": dict(mixer="kdn_exact"),
    "transformer": dict(mixer="transformer"),
}
BATCH, LENGTH, PREFILL, PADDING = 2, 20, 17, 3
LR, WEIGHT_DECAY = 1e-2, 0.1


def tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, SIZES["vocab_size"], (BATCH, LENGTH), generator=generator)


def padding_mask() -> torch.Tensor:
    """Left padding: the first row starts PADDING tokens late."""
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[0, :PADDING] = 0
    return mask


def build(name: str) -> CausalLM:
    torch.manual_seed(SEED)
    return CausalLM(DeltaLabConfig(**{**SIZES, **VARIANTS[name]}))


@torch.no_grad()
def logits(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's logits in eval mode: whole sequence, left-padded, prefill + token by token."""
    model.eval()
    ids = tokens()
    out = model(ids[:, :PREFILL], use_cache=True)
    steps, cache = [out.logits], out.past_key_values
    for t in range(PREFILL, LENGTH):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits)
        cache = out.past_key_values
    return {
        "full": model(ids).logits,
        "padded": model(ids, attention_mask=padding_mask()).logits,
        "decoded": torch.cat(steps, dim=1),
    }


def train_step(model: CausalLM) -> dict[str, torch.Tensor]:
    """Parameters after one AdamW step on the next-token loss of the fixed tokens."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def flat(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
    """All parameters as one vector, in `named_parameters` order (one tensor per variant keeps
    the reference file small)."""
    return torch.cat([p.flatten() for p in parameters.values()])


def main() -> None:
    # The tests run on one thread (tests/conftest.py); the reference is recorded the same way.
    torch.set_num_threads(1)
    shutil.rmtree(HERE, ignore_errors=True)
    reference = {}
    for name in VARIANTS:
        model = build(name)
        model.save_pretrained(HERE / name)
        reference[name] = {"logits": logits(model), "trained": flat(train_step(model))}
    torch.save({"tokens": tokens(), "reference": reference}, HERE / "reference.pt")


if __name__ == "__main__":
    main()
