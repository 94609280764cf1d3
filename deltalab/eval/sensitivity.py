"""Gate sensitivity of a trained checkpoint (`deltalab eval --task gate-sensitivity`).

    deltalab eval runs/default/model --task gate-sensitivity probes=8

For every delta-rule layer of the model, how far each of its gates moves the layer's final
memory and the next-token loss per unit perturbation (`deltalab.analysis.gate_sensitivity`,
docs/MATH.md sec. 4.4), on a batch of held-out windows; with `at_init`, the same for the model
as it was initialized, so training's effect shows. Per layer also the erase/write ratio (where
the mixer has both gates) and, from the measured numbers, the ranks `allocate_ranks` gives the
fused gate projection against the ranks the model (Muir, KDN-Muir) or the fused preset of its
family uses (`deltalab.analysis.gate_sensitivity.rank_allocation`).

A model without delta-rule layers (a Transformer) has no gates and is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deltalab.eval.common import (
    EvalError,
    LoadedCheckpoint,
    run_train_field,
    source_tokens,
)
from deltalab.eval.settings import GateSensitivitySettings
from deltalab.eval.tasks import TaskContext, TaskOutcome

__all__ = ["DEFAULT_SEQ_LEN", "GateSensitivitySettings", "erase_write_ratio", "gate_sensitivity"]

# Window length when neither the settings nor the run config give one.
DEFAULT_SEQ_LEN = 256
KINDS = ("state", "loss")


def erase_write_ratio(per_gate: dict[str, float]) -> float | None:
    """erase / write of one layer's reported sensitivities; None without both gates (or with a
    write sensitivity of 0)."""
    if "erase" not in per_gate or "write" not in per_gate or per_gate["write"] == 0:
        return None
    return per_gate["erase"] / per_gate["write"]


def _delta_layers(loaded: LoadedCheckpoint) -> dict[str, Any]:
    from deltalab.layers.delta_mixer import DeltaMixer

    layers = {n: m for n, m in loaded.model.named_modules() if isinstance(m, DeltaMixer)}
    if not layers:
        raise EvalError(
            f"gate-sensitivity needs gated delta-rule layers; checkpoint {loaded.path} "
            f"({loaded.mixer}) has none (softmax attention has no gates)"
        )
    return layers


def _batch(settings: GateSensitivitySettings, loaded: LoadedCheckpoint, seq_len: int, seed: int):
    """`batch_size` windows `[B, seq_len + 1]` of the text, drawn by `seed`, and their indices."""
    from deltalab.data import PackedSequences

    tokens = source_tokens(settings, loaded.tokenizer)
    try:
        windows = PackedSequences(tokens, seq_len)
    except ValueError as error:
        raise EvalError(f"seq_len={seq_len}: {error}") from error
    if len(windows) < settings.batch_size:
        raise EvalError(
            f"batch_size={settings.batch_size} needs {settings.batch_size} windows of {seq_len} "
            f"tokens but source {settings.source!r} split {settings.split!r} holds "
            f"{len(windows)}; use fewer or shorter windows, or a larger source"
        )
    generator = torch.Generator().manual_seed(seed)
    chosen = sorted(torch.randperm(len(windows), generator=generator)[: settings.batch_size])
    indices = [int(i) for i in chosen]
    return torch.stack([windows[i] for i in indices]), indices


def _initial_model(loaded: LoadedCheckpoint, seed: int) -> Any:
    """The checkpoint's architecture with the weights `deltalab train` draws for `seed`
    (`torch.manual_seed(seed)`, then `CausalLM(config)`), on the checkpoint's device and dtype;
    the global random state is left as it was. The weights this code draws: for a checkpoint
    trained before commit `4cb261d` (whose FFN started at PyTorch's default init, not at
    normal(0, initializer_range)) they are not the ones its run started from."""
    from deltalab.models import CausalLM

    reference = next(loaded.model.parameters())
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = CausalLM(loaded.model.config)
    return model.to(device=reference.device, dtype=reference.dtype).eval()


def _measure(model: Any, batch: torch.Tensor, settings: GateSensitivitySettings, seed: int):
    """Per layer and gate the state and loss sensitivity, the erase/write ratios and the rank
    allocations, and the same for the mean over layers."""
    from deltalab.analysis.gate_sensitivity import gate_sensitivity, rank_allocation

    def loss_fn(model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    report = gate_sensitivity(
        model,
        batch,
        loss_fn=loss_fn,
        probes=settings.probes,
        seed=seed,
        per_pass=settings.per_pass,
    )
    modules = dict(model.named_modules())
    layers: dict[str, Any] = {}
    for name in report.layers:
        values = {kind: getattr(report, kind)[name] for kind in KINDS}
        layers[name] = {
            **values,
            "erase_write": {kind: erase_write_ratio(values[kind]) for kind in KINDS},
            "ranks": {kind: rank_allocation(values[kind], modules[name]) for kind in KINDS},
        }
    means = {kind: report.mean(kind) for kind in KINDS}
    first = modules[report.layers[0]]
    mean = {
        **means,
        "erase_write": {kind: erase_write_ratio(means[kind]) for kind in KINDS},
        "ranks": {kind: rank_allocation(means[kind], first) for kind in KINDS},
    }
    return {"layers": layers, "mean": mean}


def _ranks_text(ranks: dict[str, int] | None) -> str:
    return "" if ranks is None else " ".join(f"{k}={v}" for k, v in ranks.items())


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    """Flat headline numbers per measured model ("trained", "init"): in how many layers erase is
    less sensitive than write, the erase/write ratio of the means over layers, the ranks
    allocated from those means."""
    summary: dict[str, Any] = {}
    for model, measured in results.items():
        layers = measured["layers"].values()
        ratios = {kind: [layer["erase_write"][kind] for layer in layers] for kind in KINDS}
        ratios = {kind: [r for r in values if r is not None] for kind, values in ratios.items()}
        for kind in KINDS:
            if ratios[kind]:
                below = sum(r < 1 for r in ratios[kind])
                summary[f"{model}_erase_below_write_{kind}"] = f"{below}/{len(ratios[kind])}"
                summary[f"{model}_erase_write_{kind}"] = measured["mean"]["erase_write"][kind]
        for kind in KINDS:
            allocation = measured["mean"]["ranks"][kind]
            if allocation is not None:
                summary[f"{model}_ranks_by_{kind}"] = _ranks_text(allocation["allocated"])
        allocation = measured["mean"]["ranks"]["loss"]
        if allocation is not None:
            summary["reference_ranks"] = _ranks_text(allocation["reference"])
    return summary


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(header), "|" + "---|" * len(header), *map(_row, rows)]


def _tables(results: dict[str, Any]) -> str:
    """Markdown: each gate's sensitivities per layer, the erase/write ratios (where there are
    both gates), the allocated ranks from the mean over layers against the reference ranks."""
    columns = [(kind, model) for kind in KINDS for model in results]
    first = next(iter(results.values()))
    header = ["layer", "gate", *[f"d {kind} ({model})" for kind, model in columns]]
    rows = [
        [layer, gate, *[_number(results[m]["layers"][layer][k][gate]) for k, m in columns]]
        for layer, measured in first["layers"].items()
        for gate in measured["state"]
    ]
    lines = _table(header, rows)

    def entry(model: str, layer: str) -> dict[str, Any]:
        measured = results[model]
        return measured["mean"] if layer == "mean" else measured["layers"][layer]

    if first["mean"]["erase_write"]["state"] is not None:
        header = ["layer", *[f"erase/write {kind} ({model})" for kind, model in columns]]
        rows = [
            [layer, *[_number(entry(m, layer)["erase_write"][k]) for k, m in columns]]
            for layer in [*first["layers"], "mean"]
        ]
        lines += ["", *_table(header, rows)]
    reference = first["mean"]["ranks"]["loss"]
    if reference is not None:
        header = ["rank", reference["source"], *[f"by {kind} ({model})" for kind, model in columns]]
        rows = [
            [name, str(rank)]
            + [str(results[m]["mean"]["ranks"][k]["allocated"][name]) for k, m in columns]
            for name, rank in reference["reference"].items()
        ]
        lines += ["", *_table(header, rows)]
        lines += [
            "",
            f"allocated: a budget of {reference['budget']} ranks split in proportion "
            "to the sensitivities' mean over layers (allocate_ranks)",
        ]
    return "\n".join(lines)


def plot_erase_write(results: dict[str, Any], path: Path) -> Path:
    """The erase/write sensitivity ratio per layer (state and loss; trained and at init)."""
    from deltalab.analysis._plot import finish_figure, new_figure

    figure = new_figure(figsize=(7, 4))
    ax = figure.add_subplot(1, 1, 1)
    for model, measured in results.items():
        layers = list(measured["layers"])
        for kind, marker, color in zip(KINDS, ("o", "s"), ("C0", "C1"), strict=True):
            ratios = [measured["layers"][layer]["erase_write"][kind] for layer in layers]
            style = "-" if model == "trained" else ":"
            label = f"{kind}, {model}"
            ax.plot(range(len(layers)), ratios, style, marker=marker, color=color, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(layers)), layers, rotation=30, ha="right")
    ax.set_ylabel("erase / write sensitivity")
    ax.set_title("erase vs write gate sensitivity per layer (below 1: erase matters less)")
    return finish_figure(figure, ax, path, legend_size=8)


def gate_sensitivity(settings: GateSensitivitySettings, ctx: TaskContext) -> TaskOutcome:
    from deltalab.analysis.gate_sensitivity import (
        SensitivityReport,
        plot_gate_sensitivity,
    )

    loaded = ctx.checkpoint
    assert loaded is not None
    _delta_layers(loaded)
    seq_len = settings.seq_len or loaded.trained_length or DEFAULT_SEQ_LEN
    loaded.allow_context(seq_len + 1, ctx.long_context)
    batch, windows = _batch(settings, loaded, seq_len, ctx.seed)
    batch = batch.to(next(loaded.model.parameters()).device)
    models = {"trained": loaded.model.eval()}
    init_seed = run_train_field(loaded.path, "seed")
    init_source = "train.seed of the run"
    if init_seed is None:
        init_seed, init_source = ctx.seed, "--seed"
    if settings.at_init:
        models["init"] = _initial_model(loaded, init_seed)
    results = {name: _measure(model, batch, settings, ctx.seed) for name, model in models.items()}
    files = []
    for name, measured in results.items():
        layers = measured["layers"]
        report = SensitivityReport(
            state={layer: values["state"] for layer, values in layers.items()},
            loss={layer: values["loss"] for layer, values in layers.items()},
            probes=settings.probes,
        )
        files.append(
            str(plot_gate_sensitivity(report, ctx.out_dir / f"gate_sensitivity_{name}.png"))
        )
    first = next(iter(results.values()))
    if any(layer["erase_write"]["state"] is not None for layer in first["layers"].values()):
        files.append(str(plot_erase_write(results, ctx.out_dir / "erase_write.png")))
    metrics = {
        **results,
        "seq_len": seq_len,
        "batch_size": settings.batch_size,
        "tokens": batch.numel(),
        "windows": windows,
        "probes": settings.probes,
        "init_seed": init_seed if settings.at_init else None,
        "init_seed_from": init_source if settings.at_init else None,
    }
    return TaskOutcome(
        metrics=metrics, summary=_summary(results), table=_tables(results), files=files
    )
