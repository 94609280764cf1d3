"""Retrieval from long contexts: passkey, RULER-style needles in a haystack, variable tracking.

Every example is a pure function of (settings, seed): a context of a controlled length in
tokens with facts ("needles") at controlled depths, a question, and the strings the answer
must contain. The model reads the context (a recurrent model in segments, in constant memory)
and continues it greedily; an example scores the fraction of expected strings found in the
continuation, and is exact when all are.

Haystacks: "noise" is one repeated paragraph (passkey, S-NIAH-1, variable tracking); natural
text is the lines of the built-in corpus (Python sources) or of the user's files.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltalab.eval.common import (
    EvalError,
    greedy_decode,
    source_documents,
    wilson_interval,
)
from deltalab.eval.settings import NeedleSettings, PasskeySettings, TextSource
from deltalab.eval.tasks import TaskContext, TaskOutcome

__all__ = [
    "NEEDLE_TASKS",
    "Example",
    "NeedleSettings",
    "PasskeySettings",
    "make_needle_example",
    "make_passkey_example",
    "score_answer",
    "write_passkey_corpus",
]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_PREFIX = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there."
)
ADJECTIVES = (
    "abundant ancient brave bright calm clever curious daring eager elegant fierce gentle "
    "glossy graceful happy hollow humble icy jolly keen lively loyal mellow mighty narrow noble "
    "odd patient proud quiet rapid rustic silent sleek smooth steady swift tidy vivid wistful"
).split()
NOUNS = (
    "anchor badger beacon canyon cedar comet crater dolphin ember falcon fjord glacier harbor "
    "heron island jasmine kettle lantern meadow nectar orchard otter pebble quarry raven "
    "saddle summit thistle tundra valley walnut willow yacht zephyr lagoon marble pigeon"
).split()
NEEDLE_TASKS = {
    # name: (haystack, key kind, value kind, keys in the context, values per key, keys asked)
    "niah-single-1": ("noise", "words", "numbers", 1, 1, 1),
    "niah-single-2": ("text", "words", "numbers", 1, 1, 1),
    "niah-single-3": ("text", "words", "uuids", 1, 1, 1),
    "niah-multikey": ("text", "words", "numbers", 4, 1, 1),
    "niah-multivalue": ("text", "words", "numbers", 1, 4, 1),
    "niah-multiquery": ("text", "words", "numbers", 4, 1, 4),
}


@dataclass(frozen=True)
class Example:
    """context: the text the model reads (question and answer prefix included); answers: the
    strings its continuation must contain; needles: the inserted facts, each once in context."""

    context: str
    answers: list[str]
    needles: list[str]
    length: int
    depths: list[float] = field(default_factory=list)


def _tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text))


def _require_room(task: str, length: int, overhead: int) -> int:
    """The haystack's token budget; EvalError when the length cannot hold the rest."""
    if length <= overhead:
        raise EvalError(
            f"lengths holds {length}: {task} needs more than the {overhead} tokens of its "
            f"instructions, needles and question; use lengths of at least {2 * overhead}"
        )
    return length - overhead


def _fill(units: list[str], start: int, budget: int, tokenizer: Any) -> list[str]:
    """Units (sentences or lines) from `start` on, cycling, until `budget` tokens are used."""
    chosen: list[str] = []
    used = 0
    index = start
    while used < budget:
        unit = units[index % len(units)]
        used += _tokens(tokenizer, unit + "\n")
        chosen.append(unit)
        index += 1
    return chosen


def _insert(units: list[str], needles: list[str], depths: list[float]) -> str:
    """The units joined by newlines, each needle on its own line at its depth (a fraction of the
    haystack: 0 before the first unit, 1 after the last); needles keep their given order."""
    lines = list(units)
    places = [round(d * len(units)) for d in depths]
    for offset, (place, needle) in enumerate(
        sorted(zip(places, needles, strict=True), key=lambda p: p[0])
    ):
        lines.insert(place + offset, needle)
    return "\n".join(lines)


def _fresh(rng: np.random.Generator, draw: Any, avoid: str, taken: set[str]) -> str:
    """A value from `draw(rng)` found neither in the haystack nor among the values drawn."""
    for _ in range(1000):
        value = draw(rng)
        if value not in taken and value not in avoid:
            taken.add(value)
            return value
    raise EvalError("could not draw a needle value absent from the haystack in 1000 tries")


def _number(rng: np.random.Generator, digits: int = 7) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def _uuid(rng: np.random.Generator) -> str:
    hexa = "".join(rng.choice(list("0123456789abcdef"), size=32))
    return f"{hexa[:8]}-{hexa[8:12]}-{hexa[12:16]}-{hexa[16:20]}-{hexa[20:]}"


def _word_key(rng: np.random.Generator) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def noise_units() -> list[str]:
    return [NOISE]


def text_units(source: TextSource, tokenizer: Any, needed: int) -> list[str]:
    """Non-blank lines of the source's documents, at least `needed` tokens of them."""
    units: list[str] = []
    used = 0
    documents = source_documents(source)
    try:
        for document in documents:
            for line in document.splitlines():
                if line.strip():
                    units.append(line.rstrip())
                    used += _tokens(tokenizer, line + "\n")
            if used >= needed:
                return units
    except ValueError as error:
        # The data layer finds an empty source only at the end of its documents.
        raise EvalError(f"haystack source {source.source!r}: {error}") from error
    raise EvalError(
        f"haystack source {source.source!r} (split {source.split!r}) holds {used} tokens of "
        f"non-blank lines, fewer than the {needed} the longest context needs"
    )


def make_passkey_example(
    length: int, depth: float, seed: int, tokenizer: Any, digits: int = 5
) -> Example:
    """A passkey of `digits` digits hidden at `depth` in repeated noise, `length` tokens in all
    (to within one noise paragraph)."""
    rng = np.random.default_rng([seed, length, round(depth * 1e6), 1])
    return _passkey(length, depth, rng, tokenizer, digits)


def _passkey(
    length: int, depth: float, rng: np.random.Generator, tokenizer: Any, digits: int
) -> Example:
    key = _number(rng, digits)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "What is the pass key? The pass key is"
    overhead = _tokens(tokenizer, f"{PASSKEY_PREFIX}\n{needle}\n\n{question}")
    budget = _require_room("passkey", length, overhead)
    haystack = _insert(_fill(noise_units(), 0, budget, tokenizer), [needle], [depth])
    context = f"{PASSKEY_PREFIX}\n{haystack}\n{question}"
    return Example(context, [key], [needle], _tokens(tokenizer, context), [depth])


def write_passkey_corpus(
    directory: str | Path,
    examples: int,
    tokenizer: Any,
    *,
    lengths: tuple[int, int] = (500, 1000),
    seed: int = 0,
    digits: int = 5,
) -> Path:
    """Training text in the passkey task's format: `examples` passkey examples, each one file
    in `directory` that ends with its answer (" KEY.\n" after the task's question), and
    `list.txt` there naming them, so that `data.source=@DIRECTORY/list.txt` trains on them
    (mixed with other text by listing more files). Each example's length is drawn uniformly
    from `lengths` (tokens, both ends included; a file runs past it by up to one noise
    paragraph and the answer) and its depth from [0, 1). The draws come from a random stream
    of their own, not the task's: keys recur (there are 90,000 of five digits), but a training
    example equal to one of the task's would take its length, its needle's place and its key
    to coincide. Returns the list's path; arguments that cannot make an example are refused
    before anything is written."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise EvalError(f"examples must be an int >= 1, got {examples!r}")
    pair = tuple(lengths) if isinstance(lengths, (tuple, list)) else ()
    if len(pair) != 2 or not all(isinstance(n, (int, np.integer)) for n in pair):
        raise EvalError(f"lengths must be two ints (low, high), got {lengths!r}")
    low, high = int(pair[0]), int(pair[1])
    if not 0 < low <= high:
        raise EvalError(f"lengths must be (low, high) with 0 < low <= high, got {lengths}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise EvalError(f"seed must be an int >= 0, got {seed!r}")
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 18:
        raise EvalError(f"digits must be an int in [1, 18], got {digits!r}")
    # The shortest example, built and dropped: a length too short for the prompt fails here
    # (with the byte tokenizer for every key; a subword tokenizer's count varies with the key).
    _passkey(low, 0.0, np.random.default_rng(0), tokenizer, digits)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    # The task's examples draw from streams keyed [seed, length, depth, 1]; these from [seed, 2].
    rng = np.random.default_rng([seed, 2])
    names = []
    for index in range(examples):
        length = int(rng.integers(low, high + 1))
        example = _passkey(length, float(rng.random()), rng, tokenizer, digits)
        name = f"passkey-{index:07d}.txt"
        (folder / name).write_text(f"{example.context} {example.answers[0]}.\n", encoding="utf-8")
        names.append(name)
    listing = folder / "list.txt"
    listing.write_text("\n".join(names) + "\n", encoding="utf-8")
    return listing


def make_needle_example(
    task: str,
    length: int,
    seed: int,
    tokenizer: Any,
    haystack_units: list[str],
    *,
    depths: tuple[float, ...] | None = None,
) -> Example:
    """One RULER-style example of `task` (a key of NEEDLE_TASKS) of about `length` tokens.

    Needles read "One of the special magic {numbers|uuids} for {key} is: {value}."; with several
    keys the asked ones are drawn among them (the others are distractors). Depths are drawn
    uniformly unless given (one per needle, in order)."""
    _, _, value_kind, num_keys, num_values, num_queries = NEEDLE_TASKS[task]
    rng = np.random.default_rng([seed, length, sum(map(ord, task))])
    start = int(rng.integers(len(haystack_units)))
    noun = "uuids" if value_kind == "uuids" else "numbers"
    keys: list[str] = []
    while len(keys) < num_keys:
        key = _word_key(rng)
        if key not in keys:
            keys.append(key)
    asked = [keys[i] for i in sorted(rng.choice(num_keys, size=num_queries, replace=False))]
    draw = _uuid if value_kind == "uuids" else _number
    # The haystack is fixed before the values, so that values can avoid its text.
    header = (
        f"Some special magic {noun} are hidden within the following text. Make sure to memorize "
        f"it. I will quiz you about the {noun} afterwards."
    )
    query = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    question = (
        f"What are all the special magic {noun} for {query} mentioned in the provided text? "
        f"The special magic {noun} for {query} mentioned in the provided text are"
    )
    sample_needle = f"One of the special magic {noun} for {keys[0]} is: {draw(rng)}."
    overhead = _tokens(tokenizer, f"{header}\n\n{question}") + num_keys * num_values * (
        _tokens(tokenizer, sample_needle + "\n")
    )
    units = _fill(haystack_units, start, _require_room(task, length, overhead), tokenizer)
    plain = "\n".join(units)
    taken: set[str] = set()
    needles, answers = [], []
    for key in keys:
        for _ in range(num_values):
            value = _fresh(rng, draw, plain, taken)
            needles.append(f"One of the special magic {noun} for {key} is: {value}.")
            if key in asked:
                answers.append(value)
    order = rng.permutation(len(needles))
    needles = [needles[i] for i in order]
    placed = (
        list(depths) if depths is not None else [float(d) for d in rng.uniform(0, 1, len(needles))]
    )
    if len(placed) != len(needles):
        raise EvalError(
            f"depths has {len(placed)} entries; task {task} places {len(needles)} needles"
        )
    context = f"{header}\n{_insert(units, needles, placed)}\n{question}"
    return Example(context, answers, needles, _tokens(tokenizer, context), placed)


def make_variable_tracking_example(
    length: int, seed: int, tokenizer: Any, *, chains: int = 1, hops: int = 4
) -> Example:
    """RULER's variable tracking: `chains` chains of `hops` + 1 assignments (`VAR AAAAA = 12345`,
    then `VAR BBBBB = AAAAA`, ...) spread in order through noise; the answer is every name of
    the first chain, all bound to its value."""
    rng = np.random.default_rng([seed, length, chains, hops, 2])
    names: list[str] = []
    while len(names) < chains * (hops + 1):
        name = "".join(rng.choice(list(string.ascii_uppercase), size=5))
        if name not in names and name not in NOISE.upper():
            names.append(name)
    values: set[str] = set()
    statements: list[list[str]] = []
    for c in range(chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        value = _fresh(rng, lambda r: _number(r, 5), NOISE, values)
        statements.append(
            [f"VAR {chain[0]} = {value}."]
            + [f"VAR {chain[i]} = {chain[i - 1]}." for i in range(1, len(chain))]
        )
    target_value = statements[0][0].split(" = ")[1].rstrip(".")
    question = (
        f"Find all variables that are assigned the value {target_value} in the text above. "
        f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
        f"variables are assigned the value {target_value}, they are:"
    )
    header = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    flat = [s for i in range(hops + 1) for chain in statements for s in [chain[i]]]
    overhead = _tokens(tokenizer, f"{header}\n\n{question}") + sum(
        _tokens(tokenizer, s + "\n") for s in flat
    )
    units = _fill(noise_units(), 0, _require_room("variable-tracking", length, overhead), tokenizer)
    # Statements in chain order, at evenly spread depths, so every name is bound before use.
    depths = [(i + 0.5) / len(flat) for i in range(len(flat))]
    context = f"{header}\n{_insert(units, flat, depths)}\n{question}"
    answers = names[: hops + 1]
    return Example(context, answers, flat, _tokens(tokenizer, context), depths)


def score_answer(output: str, answers: list[str]) -> float:
    """The fraction of `answers` found in `output` (RULER's string-match-all)."""
    return sum(answer in output for answer in answers) / len(answers)


def _answer(loaded: Any, example: Example, segment_len: int, max_new_tokens: int) -> str:
    tokenizer = loaded.tokenizer
    ids = torch.tensor([tokenizer.encode(example.context)])
    from deltalab.models.prefill import prefill

    cache, logits = prefill(loaded.model, ids, segment_len)
    eos = tokenizer.eos_id
    out = greedy_decode(
        loaded.model, cache, logits, max_new_tokens, stop=lambda row, tokens: tokens[-1] == eos
    )[0]
    return tokenizer.decode(out)


def _new_tokens(tokenizer: Any, answers: list[str], given: int | None) -> int:
    if given is not None:
        return given
    # Room for every answer and a separator after each.
    return sum(_tokens(tokenizer, a) + 3 for a in answers) + 4


def _summary_rows(results: list[dict[str, Any]], by: str) -> tuple[list[str], dict[str, Any]]:
    lines = [f"| {by} | examples | score | exact | exact 95% CI |", "|---|---|---|---|---|"]
    per: dict[str, Any] = {}
    for value in sorted({r[by] for r in results}):
        chosen = [r for r in results if r[by] == value]
        exact = sum(r["exact"] for r in chosen)
        low, high = wilson_interval(exact, len(chosen))
        score = sum(r["score"] for r in chosen) / len(chosen)
        per[str(value)] = {
            "examples": len(chosen),
            "score": score,
            "exact": exact / len(chosen),
            "ci95": [low, high],
        }
        lines.append(
            f"| {value} | {len(chosen)} | {score:.3f} | {exact / len(chosen):.3f} | [{low:.3f}, {high:.3f}] |"
        )
    return lines, per


def passkey(settings: PasskeySettings, ctx: TaskContext) -> TaskOutcome:
    loaded = ctx.checkpoint
    assert loaded is not None
    tokenizer = loaded.tokenizer
    results = []
    total = len(settings.lengths) * len(settings.depths) * settings.samples
    bar = ctx.bar(total=total, unit="example", desc="passkey")
    examples = [
        (
            length,
            depth,
            make_passkey_example(length, depth, ctx.seed * 1000 + s, tokenizer, settings.digits),
        )
        for length in settings.lengths
        for depth in settings.depths
        for s in range(settings.samples)
    ]
    loaded.allow_context(
        max(e.length for _, _, e in examples) + settings.digits + 8, ctx.long_context
    )
    for length, depth, example in examples:
        new = _new_tokens(tokenizer, example.answers, settings.max_new_tokens)
        output = _answer(loaded, example, settings.segment_len, new)
        # The first number of the continuation is the model's answer.
        digits = "".join(c if c.isdigit() else " " for c in output).split()
        exact = bool(digits) and digits[0] == example.answers[0]
        results.append(
            {
                "length": length,
                "depth": depth,
                "tokens": example.length,
                "score": float(exact),
                "exact": exact,
                "output": output[:80],
            }
        )
        bar.update(1)
    bar.close()
    grid = [
        [
            sum(r["exact"] for r in results if r["length"] == n and r["depth"] == d)
            / settings.samples
            for n in settings.lengths
        ]
        for d in settings.depths
    ]
    plot = _heatmap(
        grid, settings.depths, settings.lengths, ctx.out_dir / "passkey.png", loaded.path
    )
    exact = sum(r["exact"] for r in results)
    low, high = wilson_interval(exact, len(results))
    lines = [
        "| depth \\ length | " + " | ".join(map(str, settings.lengths)) + " |",
        "|" + "---|" * (len(settings.lengths) + 1),
    ]
    lines += [
        f"| {d:g} | " + " | ".join(f"{v:.2f}" for v in row) + " |"
        for d, row in zip(settings.depths, grid, strict=True)
    ]
    lines.append(
        f"\naccuracy {exact / len(results):.3f} (95% CI [{low:.3f}, {high:.3f}], {len(results)} examples)"
    )
    metrics = {
        "accuracy": exact / len(results),
        "ci95": [low, high],
        "grid": grid,
        "depths": settings.depths,
        "lengths": settings.lengths,
        "examples": results,
    }
    summary = {"accuracy": exact / len(results)}
    summary.update(
        {
            f"acc@{n}": sum(r["exact"] for r in results if r["length"] == n)
            / (len(settings.depths) * settings.samples)
            for n in settings.lengths
        }
    )
    return TaskOutcome(metrics=metrics, summary=summary, table="\n".join(lines), files=[str(plot)])


def _heatmap(grid: list[list[float]], depths: Any, lengths: Any, path: Any, title: str) -> Any:
    from deltalab.analysis._plot import new_figure, save_figure

    fig = new_figure(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(np.array(grid), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"passkey accuracy: {title}", fontsize=9)
    fig.colorbar(image, ax=ax)
    return save_figure(fig, path)


def needle_examples(
    task: str, settings: NeedleSettings, seed: int, tokenizer: Any
) -> list[Example]:
    """Every example of `task` for these settings (a pure function of settings and seed)."""
    if task == "variable-tracking":

        def make(length: int, seed: int) -> Example:
            return make_variable_tracking_example(
                length, seed, tokenizer, chains=settings.chains, hops=settings.hops
            )

    else:
        units = (
            noise_units()
            if NEEDLE_TASKS[task][0] == "noise"
            else text_units(settings.text_source(), tokenizer, max(settings.lengths))
        )

        def make(length: int, seed: int) -> Example:
            return make_needle_example(task, length, seed, tokenizer, units)

    return [make(n, seed * 1000 + s) for n in settings.lengths for s in range(settings.samples)]


def needle_runner(task: str) -> Any:
    """The function that runs the needle task `task` (a key of NEEDLE_TASKS, or
    variable-tracking)."""

    def run(settings: NeedleSettings, ctx: TaskContext) -> TaskOutcome:
        loaded = ctx.checkpoint
        assert loaded is not None
        examples = needle_examples(task, settings, ctx.seed, loaded.tokenizer)
        longest = max(
            e.length + _new_tokens(loaded.tokenizer, e.answers, settings.max_new_tokens)
            for e in examples
        )
        loaded.allow_context(longest, ctx.long_context)
        results = []
        bar = ctx.bar(total=len(examples), unit="example", desc=task)
        for index, example in enumerate(examples):
            new = _new_tokens(loaded.tokenizer, example.answers, settings.max_new_tokens)
            output = _answer(loaded, example, settings.segment_len, new)
            score = score_answer(output, example.answers)
            length = settings.lengths[index // settings.samples]
            results.append(
                {
                    "length": length,
                    "tokens": example.length,
                    "score": score,
                    "exact": score == 1.0,
                    "answers": example.answers,
                    "output": output[:120],
                }
            )
            bar.update(1)
        bar.close()
        lines, per = _summary_rows(results, "length")
        exact = sum(r["exact"] for r in results)
        low, high = wilson_interval(exact, len(results))
        score = sum(r["score"] for r in results) / len(results)
        metrics = {
            "score": score,
            "exact": exact / len(results),
            "ci95": [low, high],
            "per_length": per,
            "examples": results,
        }
        summary = {"score": score, **{f"score@{k}": v["score"] for k, v in per.items()}}
        return TaskOutcome(metrics=metrics, summary=summary, table="\n".join(lines))

    return run
