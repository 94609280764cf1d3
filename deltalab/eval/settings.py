"""The settings of every `deltalab eval` task: frozen dataclasses whose docstrings have one
`name: text` line per field (`deltalab eval --list` prints them), checked on construction.

Apart from the task code (deltalab/eval/tasks.py imports a task's module when it runs), so that
listing the tasks and refusing a bad setting import no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltalab.catalog import MIXER_KINDS
from deltalab.errors import EvalError, closest

__all__ = [
    "GateSensitivitySettings",
    "LmEvalSettings",
    "MQARConfig",
    "MQARTrainSettings",
    "NeedleSettings",
    "PasskeySettings",
    "PerplexitySettings",
    "StreamingSettings",
    "TextSource",
    "require",
]


def require(ok: bool, name: str, expected: str, value: Any) -> None:
    """EvalError `name must be <expected>, got <value>` unless `ok`."""
    if not ok:
        raise EvalError(f"{name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class TextSource:
    """Where text comes from (see `deltalab.data.CorpusConfig`); the tokens are cached under
    `cache_dir` as for training.

    source: "stdlib" (the built-in corpus), an archive or @LIST of files, or a path: a file, a
        directory of .txt/.jsonl/.parquet.
    split: "held_out" (documents the training run did not see), "train" or "all".
    held_out_fraction: the fraction of documents in the held-out split (as in training).
    max_bytes: stop reading documents after this many bytes (null: all of the split).
    text_field: JSON field or parquet column of the text.
    cache_dir: where the tokenized text is cached.
    """

    source: str = "stdlib"
    split: str = "held_out"
    held_out_fraction: float = 0.05
    max_bytes: int | None = None
    text_field: str = "text"
    cache_dir: str = "runs/token-cache"


@dataclass(frozen=True)
class PerplexitySettings(TextSource):
    """Settings of the perplexity task (the text's other settings are `TextSource`'s).

    seq_len: tokens per window (null: the checkpoint's training length, else 1024).
    max_tokens: score at most this many tokens (whole windows; null: every window).
    batch_size: windows per forward pass.
    segment_len: longer windows are read in segments of this many tokens through the cache.
    validation_fraction: the first this fraction of the scored windows is the validation part,
        reported apart (`validation_loss`, `validation_bits_per_byte`); the loss, perplexity and
        bits per byte are the other windows', the test part (windows follow the text's order,
        so only a document across the boundary window is in both). 0 (the default): every
        window is the test part. A study sets it when it chooses a learning rate.
    """

    seq_len: int | None = None
    max_tokens: int | None = 262144
    batch_size: int = 8
    segment_len: int = 4096
    validation_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("seq_len", "max_tokens"):
            value = getattr(self, name)
            require(value is None or value > 0, name, "a positive int or null", value)
        require(self.batch_size > 0, "batch_size", "a positive int", self.batch_size)
        require(self.segment_len > 0, "segment_len", "a positive int", self.segment_len)
        fraction = self.validation_fraction
        require(0 <= fraction < 1, "validation_fraction", "a number in [0, 1)", fraction)


@dataclass(frozen=True)
class StreamingSettings(TextSource):
    """Settings of the streaming task (the text's other settings are `TextSource`'s).

    split: "held_out", "train" or "all" (the stdlib's held-out split holds 475K byte tokens;
        longer streams need "all", which includes training documents).
    tokens: length of the stream (tokens whose next token is predicted).
    segment_len: tokens read per forward pass; memory does not grow with the stream.
    first_bucket: the first bucket is positions [0, first_bucket); then they double.
    """

    tokens: int = 262144
    segment_len: int = 2048
    first_bucket: int = 64

    def __post_init__(self) -> None:
        require(self.tokens > 1, "tokens", "an int > 1", self.tokens)
        require(self.segment_len > 0, "segment_len", "a positive int", self.segment_len)
        require(self.first_bucket > 0, "first_bucket", "a positive int", self.first_bucket)


@dataclass(frozen=True)
class GateSensitivitySettings(TextSource):
    """Settings of the gate-sensitivity task (the text's settings are `TextSource`'s).

    seq_len: tokens per window (null: the checkpoint's training length, else 256).
    batch_size: windows in the batch the derivatives are taken on, drawn by --seed.
    probes: random unit directions per gate (the estimate's error falls as 1/sqrt(probes)).
    at_init: also measure the model at initialization: the run's own initial weights (its
        train.seed, from config.yaml beside the checkpoint), else drawn with --seed.
    per_pass: directions one forward pass carries (null: `probes`, one gate's probes a pass;
        more saves passes and costs memory; the numbers agree up to rounding:
        `deltalab.analysis.gate_sensitivity`'s `per_pass`).
    """

    seq_len: int | None = None
    batch_size: int = 4
    probes: int = 4
    at_init: bool = True
    per_pass: int | None = None

    def __post_init__(self) -> None:
        require(self.seq_len is None or self.seq_len > 0, "seq_len", "a positive int", self.seq_len)
        require(self.batch_size > 0, "batch_size", "a positive int", self.batch_size)
        require(self.probes > 0, "probes", "a positive int", self.probes)
        require(
            self.per_pass is None or self.per_pass > 0, "per_pass", "a positive int", self.per_pass
        )


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
    validation_examples: validation examples per test setting (generated apart from the test
        examples); the learning rate is chosen on them.
    lrs: learning rates swept; each mixer reports its test accuracy at the one rate with the
        best mean validation accuracy over the test settings (the test examples choose
        nothing).
    steps: optimizer steps per model.
    batch_size: examples per step.
    weight_decay: AdamW weight decay.
    power_a: the query-gap exponent of every setting.
    tie_embeddings: share the output head's weights with the token embedding (Zoology's
        models do). False by default: only values are ever targets, so through a tied head
        every key's row is pushed the same way at every answer and the keys' embeddings
        collapse toward one direction (mean pairwise cosine 0.86 after 1,000 steps at 64x4),
        which leaves attention unable to tell the keys apart: a 2-block Transformer then stays
        near 0.3-0.4 on 64x4 where untied it solves it (docs/STUDY.md).
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
    validation_examples: int = 200
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    steps: int = 400
    batch_size: int = 32
    weight_decay: float = 0.1
    power_a: float = 0.01
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
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
            "validation_examples",
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


@dataclass(frozen=True)
class PasskeySettings:
    """Settings of the passkey task.

    lengths: context lengths in tokens.
    depths: needle depths, fractions of the haystack (0: start, 1: end).
    samples: examples per (depth, length) cell, each with its own key.
    digits: digits of the pass key.
    segment_len: tokens read per forward pass (recurrent models: constant memory).
    max_new_tokens: tokens generated for the answer (null: enough for the key).
    """

    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 4
    digits: int = 5
    segment_len: int = 2048
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        _require_lengths(self.lengths)
        require(
            len(self.depths) > 0 and all(0 <= d <= 1 for d in self.depths),
            "depths",
            "a list of numbers in [0, 1]",
            self.depths,
        )
        require(self.samples > 0, "samples", "a positive int", self.samples)
        require(1 <= self.digits <= 18, "digits", "an int in [1, 18]", self.digits)
        require(self.segment_len > 0, "segment_len", "a positive int", self.segment_len)
        _require_new_tokens(self.max_new_tokens)


def _require_lengths(lengths: tuple[int, ...]) -> None:
    require(
        len(lengths) > 0 and all(n > 0 for n in lengths),
        "lengths",
        "a list of positive ints",
        lengths,
    )


def _require_new_tokens(value: int | None) -> None:
    # No token to answer with scores 0 whatever the model knows: not a measurement.
    require(value is None or value > 0, "max_new_tokens", "a positive int or null", value)


@dataclass(frozen=True)
class NeedleSettings:
    """Settings of the RULER-style needle tasks and variable tracking.

    lengths: context lengths in tokens.
    samples: examples per length (needle depths drawn uniformly, as in RULER).
    source: haystack of the natural-text variants: "stdlib" (the built-in corpus) or a path.
    split: documents of the haystack: "held_out", "train" or "all".
    held_out_fraction: the fraction of documents in the held-out split (as in training).
    max_bytes: read at most this many bytes of the source (null: as much as needed).
    text_field: JSON field or parquet column of the text.
    segment_len: tokens read per forward pass (recurrent models: constant memory).
    max_new_tokens: tokens generated per answer (null: enough for the expected answers).
    chains: variable tracking: chains of assignments (the others are distractors).
    hops: variable tracking: reassignments per chain.
    """

    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    samples: int = 10
    source: str = "stdlib"
    split: str = "held_out"
    held_out_fraction: float = 0.05
    max_bytes: int | None = None
    text_field: str = "text"
    segment_len: int = 2048
    max_new_tokens: int | None = None
    chains: int = 1
    hops: int = 4

    def __post_init__(self) -> None:
        _require_lengths(self.lengths)
        require(self.samples > 0, "samples", "a positive int", self.samples)
        require(self.segment_len > 0, "segment_len", "a positive int", self.segment_len)
        require(self.chains > 0, "chains", "a positive int", self.chains)
        require(self.hops > 0, "hops", "a positive int", self.hops)
        _require_new_tokens(self.max_new_tokens)

    def text_source(self) -> TextSource:
        return TextSource(
            source=self.source,
            split=self.split,
            held_out_fraction=self.held_out_fraction,
            max_bytes=self.max_bytes,
            text_field=self.text_field,
        )


@dataclass(frozen=True)
class LmEvalSettings:
    """Settings of lm-eval:TASKS.

    tasks: lm-eval task names, comma-separated (given after `lm-eval:`).
    num_fewshot: few-shot examples per prompt (null: each task's default).
    limit: examples per task: an int, or a fraction of the task when < 1 (null: all).
    batch_size: requests per forward pass.
    segment_len: tokens per forward pass; longer inputs continue through the cache.
    include_path: a folder of extra task definitions (YAML), e.g. local tasks.
    max_gen_toks: default generation length of generate_until tasks.
    """

    tasks: str = ""
    num_fewshot: int | None = None
    limit: float | None = None
    batch_size: int = 8
    segment_len: int = 2048
    include_path: str | None = None
    max_gen_toks: int = 256

    def __post_init__(self) -> None:
        names = [t for t in self.tasks.split(",") if t.strip()]
        require(
            len(names) > 0,
            "tasks",
            "one or more lm-eval task names (lm-eval:TASK1,TASK2)",
            self.tasks,
        )
        require(
            self.num_fewshot is None or self.num_fewshot >= 0,
            "num_fewshot",
            "an int >= 0 or null",
            self.num_fewshot,
        )
        require(
            self.limit is None or self.limit > 0, "limit", "a positive number or null", self.limit
        )
        require(self.batch_size > 0, "batch_size", "a positive int", self.batch_size)
        require(self.segment_len > 0, "segment_len", "a positive int", self.segment_len)
