"""Multi-query associative recall (MQAR), as in the Zoology benchmark (Arora et al., 2023).

A sequence opens with key-value pairs, then asks for the keys again, each query at a distance
drawn from a power law; the model must answer each query with the value that followed that key.
`generate_mqar` makes the data as a pure function of (settings, seed); `train_mqar` (`deltalab
eval --task mqar-train`) trains small models of any mixer on a mixture of (length, pairs)
settings, sweeps the learning rate, chooses one rate per mixer on validation examples and
reports the test accuracy at that rate per setting, including settings it was not trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from deltalab.eval.common import wilson_interval
from deltalab.eval.settings import MQARConfig, MQARTrainSettings
from deltalab.eval.tasks import TaskContext, TaskOutcome
from deltalab.ops._checks import NonFiniteError

__all__ = [
    "IGNORE",
    "MQARConfig",
    "MQARData",
    "MQARTrainSettings",
    "choose_by_validation",
    "generate_mqar",
    "train_mqar",
]

IGNORE = -100
# Seed offsets of the evaluation sets: the test and validation examples are neither the
# training examples nor each other.
TEST_SEED, VALIDATION_SEED = 1_000_003, 2_000_003


@dataclass(frozen=True)
class MQARData:
    """inputs `[N, L]` tokens; labels `[N, L]`: at a query position, the value the model must
    predict as the next token (which is also inputs at the next position); IGNORE elsewhere."""

    inputs: torch.Tensor
    labels: torch.Tensor


def generate_mqar(config: MQARConfig, seed: int) -> MQARData:
    """MQAR examples, a pure function of (config, seed) (a local NumPy generator).

    Layout of an example: `k1 v1 k2 v2 ... kP vP`, then filler with each key asked once at a
    query slot; slot s holds the query at `2P + 2s` and its answer at `2P + 2s + 1`. Slots are
    drawn without replacement with p(s) ~ (s + 1)^(power_a - 1); filler tokens are uniform over
    the whole vocabulary. Keys and values are drawn without replacement per example.

    Example (vocab_size=8: keys 0-3, values 4-7; seq_len=12, num_pairs=2, seed=0)::

        >>> data = generate_mqar(MQARConfig(vocab_size=8, seq_len=12, num_pairs=2,
        ...                                 num_examples=1), seed=0)
        >>> data.inputs[0].tolist()
        [0, 5, 2, 4, 3, 2, 0, 5, 2, 4, 7, 7]
        >>> data.labels[0].tolist()
        [-100, -100, -100, -100, -100, -100, 5, -100, 4, -100, -100, -100]

    Key 0 is paired with 5 and key 2 with 4; key 0 is asked at position 6 (label 5, the answer
    then stands at position 7), key 2 at position 8 (label 4); positions 4, 5, 10 and 11 are
    filler (filler may repeat a key, as position 5 does, but is never labelled).
    """
    rng = np.random.default_rng([seed, config.seq_len, config.num_pairs, config.vocab_size])
    n, length, pairs = config.num_examples, config.seq_len, config.num_pairs
    half = config.vocab_size // 2
    slots = config.query_slots
    weights = np.arange(1, slots + 1, dtype=np.float64) ** (config.power_a - 1)
    weights /= weights.sum()
    inputs = rng.integers(0, config.vocab_size, size=(n, length), dtype=np.int64)
    labels = np.full((n, length), IGNORE, dtype=np.int64)
    for row in range(n):
        keys = rng.choice(half, size=pairs, replace=False)
        values = rng.choice(half, size=pairs, replace=False) + half
        inputs[row, 0 : 2 * pairs : 2] = keys
        inputs[row, 1 : 2 * pairs : 2] = values
        chosen = rng.choice(slots, size=pairs, replace=False, p=weights)
        order = rng.permutation(pairs)
        positions = 2 * pairs + 2 * chosen
        inputs[row, positions] = keys[order]
        inputs[row, positions + 1] = values[order]
        labels[row, positions] = values[order]
    return MQARData(torch.from_numpy(inputs), torch.from_numpy(labels))


def _model(settings: MQARTrainSettings, mixer: str, seed: int) -> Any:
    from deltalab.models import CausalLM, DeltaLabConfig

    config = DeltaLabConfig(
        mixer=mixer,
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        head_dim=settings.hidden_size // settings.num_heads,
        vocab_size=settings.vocab_size,
        tie_word_embeddings=settings.tie_embeddings,
        # Chunks no longer than the shortest sequence keep the chunked kernels' work small.
        chunk_size=max(16, min(64, min(s[0] for s in settings.train))),
        mixer_options=dict(settings.mixer_options) if mixer != "transformer" else None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return CausalLM(config)


def recall_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at the answer positions only (labels aligned with the predicting position)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def recall_accuracy(model: Any, data: MQARData, batch_size: int = 64) -> tuple[int, int]:
    """(answers predicted right by argmax, answers) over `data`, on the model's device."""
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    for start in range(0, data.inputs.shape[0], batch_size):
        inputs = data.inputs[start : start + batch_size].to(device)
        labels = data.labels[start : start + batch_size].to(device)
        logits = model(input_ids=inputs).logits
        answer = labels != IGNORE
        correct += int((logits.argmax(-1)[answer] == labels[answer]).sum())
        total += int(answer.sum())
    model.train()
    return correct, total


def train_one(
    settings: MQARTrainSettings,
    mixer: str,
    lr: float,
    seed: int,
    train_sets: list[MQARData],
    bar: Any = None,
    device: str = "cpu",
) -> Any:
    """A model of `mixer` trained on `device` on the training settings in turn (AdamW, warmup
    then cosine); initialization and example order depend on `seed` alone."""
    model = _model(settings, mixer, seed).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": other, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.98),
    )
    warmup = max(1, settings.steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, settings.steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    order = np.random.default_rng([seed, 1]).permutation
    perms = [order(data.inputs.shape[0]) for data in train_sets]
    cursor = [0] * len(train_sets)
    for step in range(settings.steps):
        which = step % len(train_sets)
        data, perm = train_sets[which], perms[which]
        if cursor[which] + settings.batch_size > len(perm):
            cursor[which] = 0
        index = torch.from_numpy(perm[cursor[which] : cursor[which] + settings.batch_size])
        cursor[which] += settings.batch_size
        logits = model(input_ids=data.inputs[index].to(device)).logits
        loss = recall_loss(logits, data.labels[index].to(device))
        if not torch.isfinite(loss):
            raise NonFiniteError(f"the loss became {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if bar is not None:
            bar.update(1)
    model.eval()
    return model


def _accuracy(model: Any, sets: dict[tuple[int, int], MQARData]) -> dict[str, Any]:
    accuracy = {}
    for (s, p), data in sets.items():
        correct, total = recall_accuracy(model, data)
        low, high = wilson_interval(correct, total)
        accuracy[f"{s}x{p}"] = {"accuracy": correct / total, "ci95": [low, high], "answers": total}
    return accuracy


def choose_by_validation(
    runs: list[dict[str, Any]], mixers: tuple[str, ...], keys: list[str]
) -> dict[str, dict[str, Any]]:
    """Per mixer, its run with the best mean validation accuracy over the settings `keys` (the
    first in the sweep's order on a tie) and that run's test accuracy per setting: mixer ->
    {"lr", "validation", and per setting the test accuracy entry}. The test accuracies choose
    nothing."""
    chosen: dict[str, dict[str, Any]] = {}
    for mixer in mixers:
        ours = [r for r in runs if r["mixer"] == mixer]

        def validation(run: dict[str, Any]) -> float:
            return sum(run["validation"][k]["accuracy"] for k in keys) / len(keys)

        top = max(ours, key=validation)  # max keeps the first of equals
        chosen[mixer] = {"lr": top["lr"], "validation": validation(top)}
        chosen[mixer].update({key: top["accuracy"][key] for key in keys})
    return chosen


def train_mqar(settings: MQARTrainSettings, ctx: TaskContext) -> TaskOutcome:
    """Every mixer at every learning rate; per mixer, the test accuracy per setting at the rate
    chosen on the validation examples."""
    # Distinct seeds per set, so that neither evaluation set holds training examples.
    train_sets = [
        generate_mqar(settings.config(s, p, settings.train_examples), ctx.seed)
        for s, p in settings.train
    ]
    test_sets = {
        (s, p): generate_mqar(settings.config(s, p, settings.test_examples), ctx.seed + TEST_SEED)
        for s, p in settings.test
    }
    validation_sets = {
        (s, p): generate_mqar(
            settings.config(s, p, settings.validation_examples), ctx.seed + VALIDATION_SEED
        )
        for s, p in settings.test
    }
    runs = []
    bar = ctx.bar(
        total=len(settings.mixers) * len(settings.lrs) * settings.steps,
        unit="step",
        desc="mqar-train",
    )
    for mixer in settings.mixers:
        for lr in settings.lrs:
            try:
                model = train_one(settings, mixer, lr, ctx.seed, train_sets, bar, ctx.device)
            except NonFiniteError as error:
                # A learning rate that diverges is a result of the sweep (no recall), reported
                # with the others, not the end of the sweep.
                nothing = {
                    f"{s}x{p}": {"accuracy": 0.0, "ci95": None, "answers": 0}
                    for s, p in settings.test
                }
                runs.append({"mixer": mixer, "lr": lr, "diverged": str(error),
                             "accuracy": nothing, "validation": nothing})  # fmt: skip
                continue
            runs.append({"mixer": mixer, "lr": lr, "accuracy": _accuracy(model, test_sets),
                         "validation": _accuracy(model, validation_sets)})  # fmt: skip
    bar.close()
    trained = {f"{s}x{p}" for s, p in settings.train}
    keys = [f"{s}x{p}" for s, p in settings.test]
    chosen = choose_by_validation(runs, settings.mixers, keys)
    header = [
        "mixer",
        "lr (validation)",
        *[f"{k}{'' if k in trained else ' (unseen)'}" for k in keys],
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for mixer in settings.mixers:
        cells = [f"{chosen[mixer]['lr']:g} ({chosen[mixer]['validation']:.3f})"]
        cells += [f"{chosen[mixer][k]['accuracy']:.3f}" for k in keys]
        lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
    table = (
        "test accuracy per (seq_len x pairs) at the learning rate chosen on validation examples "
        "(mean validation accuracy in parentheses); 95% Wilson intervals in results.json\n\n"
        + "\n".join(lines)
    )
    summary: dict[str, float] = {}
    for mixer in settings.mixers:
        summary.update({f"{mixer}@{k}": chosen[mixer][k]["accuracy"] for k in keys})
        summary[f"{mixer}@lr"] = chosen[mixer]["lr"]
        summary[f"{mixer}@validation"] = chosen[mixer]["validation"]
    metrics = {"chosen": chosen, "runs": runs, "trained_settings": sorted(trained)}
    return TaskOutcome(metrics=metrics, summary=summary, table=table)
