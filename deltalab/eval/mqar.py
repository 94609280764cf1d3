"""Multi-query associative recall (MQAR), as in the Zoology benchmark (Arora et al., 2023).

A sequence opens with key-value pairs, then asks for the keys again, each query at a distance
drawn from a power law; the model must answer each query with the value that followed that key.
`generate_mqar` makes the data as a pure function of (settings, seed); `train_mqar` (`deltalab
eval --task mqar-train`) trains small models of any mixer on a mixture of (length, pairs)
settings, sweeps the learning rate and reports the best accuracy per setting, including
settings it was not trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from deltalab.eval.common import EvalError, wilson_interval
from deltalab.eval.tasks import Task, TaskContext, TaskOutcome, register, require
from deltalab.ops._checks import NonFiniteError

__all__ = ["IGNORE", "MQARConfig", "MQARData", "MQARTrainSettings", "generate_mqar", "train_mqar"]

IGNORE = -100


@dataclass(frozen=True)
class MQARConfig:
    """One MQAR setting.

    vocab_size: keys are tokens [0, vocab_size // 2), values [vocab_size // 2, vocab_size).
    seq_len: tokens per example.
    num_pairs: key-value pairs per example, every key queried once.
    num_examples: examples to generate.
    power_a: exponent of the query-gap law p(gap) ~ gap^(power_a - 1): small means short gaps
        are much more likely than long ones (Zoology uses 0.01).
    """

    vocab_size: int = 128
    seq_len: int = 64
    num_pairs: int = 4
    num_examples: int = 100
    power_a: float = 0.01

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_pairs", "num_examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EvalError(f"MQAR {name} must be a positive int, got {value!r}")
        if self.vocab_size < 4:
            raise EvalError(
                f"MQAR vocab_size must be >= 4 (two keys, two values), got {self.vocab_size}"
            )
        if not 0 < self.power_a <= 1:
            raise EvalError(f"MQAR power_a must be in (0, 1], got {self.power_a}")
        keys = self.vocab_size // 2
        if self.num_pairs > keys:
            raise EvalError(
                f"MQAR num_pairs={self.num_pairs} cannot be drawn without replacement from the "
                f"{keys} keys of vocab_size={self.vocab_size}; raise vocab_size to at least "
                f"{2 * self.num_pairs} or lower num_pairs"
            )
        if self.query_slots < self.num_pairs:
            raise EvalError(
                f"MQAR seq_len={self.seq_len} leaves {self.query_slots} query slots after "
                f"{self.num_pairs} pairs, fewer than the {self.num_pairs} queries; seq_len must "
                f"be at least {4 * self.num_pairs}"
            )

    @property
    def query_slots(self) -> int:
        """Places for a (query, answer) couple after the pairs: every other position."""
        return (self.seq_len - 2 * self.num_pairs) // 2


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


@dataclass(frozen=True)
class MQARTrainSettings:
    """Settings of mqar-train.

    mixers: mixer kinds to train (deltalab.models.MIXER_KINDS).
    mixer_options: options of the recurrent mixers (the model config's mixer_options, e.g.
        {read_gate: static} for Muir); attention blocks take none.
    hidden_size: model width (64-256 in Zoology's sweeps).
    num_layers: blocks per model.
    num_heads: heads per mixer (head_dim = hidden_size // num_heads).
    vocab_size: MQAR vocabulary (half keys, half values).
    train: (seq_len, num_pairs) settings mixed in training, one per step in turn.
    test: (seq_len, num_pairs) settings measured after training (may be longer, unseen).
    train_examples: training examples generated per training setting.
    test_examples: test examples per test setting.
    lrs: learning rates swept; each setting reports the best one.
    steps: optimizer steps per model.
    batch_size: examples per step.
    weight_decay: AdamW weight decay.
    power_a: the query-gap exponent of every setting.
    """

    mixers: tuple[str, ...] = ("transformer", "gdn2", "muir", "kdn_diag")
    mixer_options: dict[str, Any] = field(default_factory=dict)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 1
    vocab_size: int = 128
    train: tuple[tuple[int, ...], ...] = ((64, 4), (128, 8))
    test: tuple[tuple[int, ...], ...] = ((64, 4), (128, 8), (256, 8), (256, 16))
    train_examples: int = 4000
    test_examples: int = 200
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    steps: int = 400
    batch_size: int = 32
    weight_decay: float = 0.1
    power_a: float = 0.01

    def __post_init__(self) -> None:
        from deltalab.models.config import MIXER_KINDS, closest

        require(len(self.mixers) > 0, "mixers", "a non-empty list", self.mixers)
        for mixer in self.mixers:
            if mixer not in MIXER_KINDS:
                raise EvalError(
                    f"mixers holds {mixer!r}, expected one of {list(MIXER_KINDS)}"
                    f"{closest(mixer, MIXER_KINDS)}"
                )
        if self.mixer_options:
            from deltalab.models.mixers import mixer_option_names

            for mixer in self.mixers:
                if mixer == "transformer":
                    continue
                known = mixer_option_names(mixer)
                for name in self.mixer_options:
                    if name not in known:
                        raise EvalError(
                            f"mixer_options.{name} is not an option of the {mixer} mixer"
                            f"{closest(name, known)}; its options are {known}"
                        )
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "train_examples",
            "test_examples",
            "steps",
            "batch_size",
        ):
            value = getattr(self, name)
            require(value > 0, name, "a positive int", value)
        require(
            self.hidden_size % self.num_heads == 0,
            "hidden_size",
            f"a multiple of num_heads={self.num_heads}",
            self.hidden_size,
        )
        require(
            len(self.lrs) > 0 and all(lr > 0 for lr in self.lrs),
            "lrs",
            "a non-empty list of positive numbers",
            self.lrs,
        )
        for name in ("train", "test"):
            settings = getattr(self, name)
            ok = len(settings) > 0 and all(len(s) == 2 for s in settings)
            require(ok, name, "a non-empty list of [seq_len, num_pairs] pairs", settings)
            for seq_len, pairs in settings:
                self.config(seq_len, pairs, 1)  # refuses settings that cannot be generated

    def config(self, seq_len: int, pairs: int, examples: int) -> MQARConfig:
        return MQARConfig(self.vocab_size, seq_len, pairs, examples, self.power_a)


def _model(settings: MQARTrainSettings, mixer: str, seed: int) -> Any:
    from deltalab.models import CausalLM, DeltaLabConfig

    config = DeltaLabConfig(
        mixer=mixer,
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        head_dim=settings.hidden_size // settings.num_heads,
        vocab_size=settings.vocab_size,
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


def train_mqar(settings: MQARTrainSettings, ctx: TaskContext) -> TaskOutcome:
    """Every mixer at every learning rate; best-of accuracy per test setting."""
    # Distinct seeds per setting, so that test examples are not the training examples.
    train_sets = [
        generate_mqar(settings.config(s, p, settings.train_examples), ctx.seed)
        for s, p in settings.train
    ]
    test_sets = {
        (s, p): generate_mqar(settings.config(s, p, settings.test_examples), ctx.seed + 1_000_003)
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
                runs.append({"mixer": mixer, "lr": lr, "diverged": str(error), "accuracy": {
                    f"{s}x{p}": {"accuracy": 0.0, "ci95": None, "answers": 0}
                    for s, p in settings.test
                }})  # fmt: skip
                continue
            accuracy = {}
            for (s, p), data in test_sets.items():
                correct, total = recall_accuracy(model, data)
                low, high = wilson_interval(correct, total)
                accuracy[f"{s}x{p}"] = {
                    "accuracy": correct / total,
                    "ci95": [low, high],
                    "answers": total,
                }
            runs.append({"mixer": mixer, "lr": lr, "accuracy": accuracy})
    bar.close()
    trained = {f"{s}x{p}" for s, p in settings.train}
    best: dict[str, dict[str, Any]] = {}
    for mixer in settings.mixers:
        best[mixer] = {}
        for key in (f"{s}x{p}" for s, p in settings.test):
            top = max(
                (r for r in runs if r["mixer"] == mixer),
                key=lambda r: r["accuracy"][key]["accuracy"],
            )
            best[mixer][key] = {**top["accuracy"][key], "lr": top["lr"]}
    keys = [f"{s}x{p}" for s, p in settings.test]
    header = ["mixer", *[f"{k}{'' if k in trained else ' (unseen)'}" for k in keys]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for mixer in settings.mixers:
        cells = [f"{best[mixer][k]['accuracy']:.3f} (lr {best[mixer][k]['lr']:g})" for k in keys]
        lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
    table = (
        "best-of-lr accuracy per (seq_len x pairs); 95% Wilson intervals in results.json\n\n"
        + "\n".join(lines)
    )
    summary = {f"{m}@{k}": best[m][k]["accuracy"] for m in settings.mixers for k in keys}
    metrics = {"best": best, "runs": runs, "trained_settings": sorted(trained)}
    return TaskOutcome(metrics=metrics, summary=summary, table=table)


register(
    Task(
        name="mqar-train",
        summary="train small models on multi-query associative recall, best-of-lr accuracy per setting",
        settings=MQARTrainSettings,
        run=train_mqar,
        needs_checkpoint=False,
    )
)
