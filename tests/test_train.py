"""deltalab train: loss falls for every family, resume is bit-for-bit, gloo DDP == one process."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import unicodedata
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from deltalab.errors import CheckpointError, DivergenceError
from deltalab.models import MIXER_KINDS
from deltalab.train import load_run_config, train
from deltalab.train.checkpoint import CheckpointWarning, list_checkpoints

SMALL_MODEL = (
    "model.overrides={hidden_size: 32, num_layers: 2, num_heads: 2, head_dim: 16, chunk_size: 16}"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def make_corpus(folder: Path) -> str:
    """A directory of 60 small documents: repetitive enough to learn in a few steps."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["def", "return", "self", "value", "for", "in", "range", "if", "else", "print"]
    for i in range(60):
        lines = [f"{words[i % 10]} item_{j} = {words[(i + j) % 10]}({j})" for j in range(12)]
        (folder / f"doc_{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return str(folder)


def run_config(tmp_path, corpus, *extra: str):
    return load_run_config(None, run_overrides(tmp_path, corpus, *extra))


def run_overrides(tmp_path, corpus, *extra: str) -> list[str]:
    """The overrides of `run_config`, as `deltalab train` takes them."""
    return [
        f"data.source={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_bytes=null",
        "data.held_out_fraction=0.2",
        SMALL_MODEL,
        "train.seq_len=32",
        "train.batch_size=4",
        "train.steps=6",
        "train.device=cpu",
        "optim.lr=0.01",
        "schedule.warmup_steps=2",
        "eval.every=3",
        "eval.batches=2",
        "eval.sample_tokens=8",
        "checkpoint.every=3",
        "checkpoint.keep=3",
        "log.progress=false",
        "log.tensorboard=false",
        f"log.out_dir={tmp_path / 'run'}",
        *extra,
    ]


def poison_loss_at(monkeypatch, call: int) -> dict[str, int]:
    """Makes the `call`-th training loss (counting from 1) NaN; returns the counter, which a
    test resets to poison a second run the same way."""
    import deltalab.train.loop as loop

    original = loop._loss
    calls = {"n": 0}

    def poisoned(model, window, autocast):
        loss = original(model, window, autocast)
        if model.training:
            calls["n"] += 1
            if calls["n"] == call:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(loop, "_loss", poisoned)
    return calls


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_a_few_steps_lower_the_held_out_loss(tmp_path, corpus, mixer):
    result = train(run_config(tmp_path, corpus, f"model.mixer={mixer}", "train.steps=10"))
    assert result.final_perplexity < result.initial_perplexity
    assert all(math.isfinite(loss) for loss in result.losses) and len(result.losses) == 10


def test_run_writes_checkpoint_export_metrics_curve_and_sample(tmp_path, corpus):
    result = train(run_config(tmp_path, corpus))
    run = tmp_path / "run"
    exported = ("model/config.json", "model/tokenizer.json", "model/tokenizer_config.json")
    for name in ("config.yaml", "metrics.json", "loss_curve.png", "log.jsonl", *exported):
        assert (run / name).stat().st_size > 0, name
    assert [p.name for p in list_checkpoints(run)] == ["step_00000003.pt", "step_00000006.pt"]
    assert isinstance(result.sample, str)


def test_the_printed_sample_escapes_control_bytes_and_the_metrics_keep_them(
    tmp_path, corpus, capsys
):
    # Two steps leave a byte model close to uniform: a sample of 200 tokens at temperature 1
    # holds control bytes (ESC, CR, ...), which would act on the terminal.
    run = train(
        run_config(
            tmp_path, corpus, "train.steps=2", "eval.sample_tokens=200",
            "eval.sample_temperature=1.0",
        )
    )  # fmt: skip
    controls = [c for c in run.sample if unicodedata.category(c) == "Cc" and c not in "\n\t"]
    assert controls, "the sample holds no control character to escape"
    printed = capsys.readouterr().out.split("sample:\n", 1)[1]
    assert not [c for c in printed if unicodedata.category(c) == "Cc" and c not in "\n\t"]
    assert f"\\x{ord(controls[0]):02x}" in printed
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["sample"] == run.sample


def test_no_sample_line_when_no_sample_is_asked_for(tmp_path, corpus, capsys):
    result = train(run_config(tmp_path, corpus, "train.steps=2", "eval.sample_tokens=0"))
    assert result.sample == ""
    assert "sample:" not in capsys.readouterr().out


def _final_weights(out_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out_dir / "model").state_dict()


def test_crash_and_resume_continues_bit_for_bit(tmp_path, corpus, monkeypatch):
    reference = train(run_config(tmp_path / "a", corpus))

    original_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def crashing_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated crash")
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", crashing_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(run_config(tmp_path / "b", corpus))
    monkeypatch.setattr(torch.optim.AdamW, "step", original_step)
    resumed = train(run_config(tmp_path / "b", corpus, "checkpoint.resume=true"))

    assert resumed.losses == reference.losses
    a, b = _final_weights(tmp_path / "a" / "run"), _final_weights(tmp_path / "b" / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The crash came after step 4 was logged and the checkpoint of step 3 was written: the
    # resumed log holds step 4 once, as the uninterrupted run's does.
    assert _logged_steps(tmp_path / "b" / "run") == _logged_steps(tmp_path / "a" / "run")


def _logged_steps(run: Path) -> list[tuple[str, int]]:
    lines = (run / "log.jsonl").read_text().splitlines()
    return [(record["kind"], record["step"]) for record in map(json.loads, lines)]


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def test_resume_refuses_unverifiable_checkpoints_instead_of_starting_over(tmp_path, corpus):
    train(run_config(tmp_path, corpus))
    run = tmp_path / "run"
    # Copied to another machine without their digests.
    for sidecar in (run / "checkpoints").glob("*.sha256"):
        sidecar.unlink()
    before = {path: path.read_bytes() for path in [*list_checkpoints(run), run / "log.jsonl"]}
    with pytest.raises(CheckpointError, match=r"none can be used") as caught:
        train(run_config(tmp_path, corpus, "checkpoint.resume=true"))
    message = str(caught.value)
    assert "step_00000003.pt: missing digest" in message and "step_00000006.pt" in message
    assert "sha256sum step_00000006.pt > step_00000006.pt.sha256" in message
    # Nothing pruned, nothing truncated.
    assert {path: path.read_bytes() for path in before} == before


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_resume_never_runs_code_from_a_planted_checkpoint(tmp_path, corpus):
    planted = tmp_path / "run" / "checkpoints" / "step_00000003.pt"
    planted.parent.mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    torch.save({"step": 3, "config": {}, "model": _RunsCode(marker)}, planted)
    digest = hashlib.sha256(planted.read_bytes()).hexdigest()
    planted.with_name(planted.name + ".sha256").write_text(f"{digest}  {planted.name}\n")
    with pytest.raises(CheckpointError, match=r"step_00000003\.pt: torch\.load\(weights_only"):
        train(run_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert not marker.exists() and planted.exists()


def test_a_checkpoint_without_its_config_is_skipped_like_a_damaged_one(tmp_path, corpus):
    reference = train(run_config(tmp_path, corpus))
    newest = list_checkpoints(tmp_path / "run")[-1]
    fake = {"step": 6, "model": {}}
    torch.save(fake, newest)
    digest = hashlib.sha256(newest.read_bytes()).hexdigest()
    newest.with_name(newest.name + ".sha256").write_text(f"{digest}  {newest.name}\n")
    with pytest.warns(CheckpointWarning, match=r"step_00000006\.pt: payload lacks .*'config'"):
        resumed = train(run_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert resumed.losses == reference.losses


def test_truncated_checkpoint_is_skipped_and_the_previous_one_resumed(tmp_path, corpus):
    reference = train(run_config(tmp_path, corpus))
    newest = list_checkpoints(tmp_path / "run")[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = train(run_config(tmp_path, corpus, "checkpoint.resume=true"))
    assert any(issubclass(w.category, CheckpointWarning) for w in caught)
    assert resumed.losses == reference.losses


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss_stops_or_skips_per_config(tmp_path, corpus, monkeypatch, policy):
    poison_loss_at(monkeypatch, 2)
    config = run_config(tmp_path, corpus, f"train.nan_policy={policy}")
    if policy == "stop":
        with pytest.raises(FloatingPointError, match=r"not finite.*train.nan_policy=stop") as e:
            train(config)
        # Step 2 fails before the first checkpoint (step 3) is due.
        assert "no checkpoint was written" in str(e.value)
    else:
        result = train(config)
        assert len(result.losses) == 5 and all(math.isfinite(x) for x in result.losses)


def test_a_diverging_recurrent_model_is_stopped_by_the_policy_with_a_hint(tmp_path, corpus):
    # At this learning rate the gates go NaN inside the forward, where the op refuses them.
    diverging = ("optim.lr=1000", "schedule.warmup_steps=0", "optim.grad_clip=0")
    with pytest.raises(DivergenceError, match=r"step 2 is not finite \(the model produced") as e:
        train(run_config(tmp_path, corpus, "model.mixer=gdn", *diverging))
    assert "no checkpoint was written" in str(e.value) and "lower optim.lr" in str(e.value)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_diverged_run_under_skip_ends_cleanly_and_says_so(tmp_path, corpus, monkeypatch, graphs):
    """With train.cuda_graphs too, where the steps refused by the model's value checks do not
    count as the graph's warmup steps (passes that stopped early leave kernels unrun): from
    step 2 on every step is refused, so the graph is never recorded."""
    import deltalab.train.graphs as graph_module

    stepped = []
    monkeypatch.setattr(graph_module.StepGraph, "step", lambda self, w: stepped.append(w))
    diverging = ("optim.lr=1000", "schedule.warmup_steps=0", "optim.grad_clip=0")
    settings = ("model.mixer=muir", "train.nan_policy=skip", f"train.cuda_graphs={graphs}")
    result = train(run_config(tmp_path, corpus, *settings, *diverging))
    assert len(result.losses) == 1 and result.sample == ""
    metrics = _metrics(tmp_path / "run")
    assert (metrics["status"], metrics["skipped_steps"]) == ("completed", 5)
    assert not stepped


def test_corpus_smaller_than_one_sequence_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"seq_len=100000 needs at least"):
        train(run_config(tmp_path, corpus, "train.seq_len=100000"))


def test_a_single_text_file_trains_on_its_head_and_evaluates_on_its_tail(tmp_path, corpus):
    # One document used to fall whole into one split, leaving the other empty.
    book = tmp_path / "book.txt"
    book.write_text("".join(p.read_text() for p in sorted(Path(corpus).glob("*.txt"))))
    result = train(run_config(tmp_path, str(book)))
    assert len(result.losses) == 6 and result.final_perplexity < result.initial_perplexity


def test_missing_data_path_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"does-not-exist"):
        train(run_config(tmp_path, str(tmp_path / "does-not-exist")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int) -> None:
    """Makes this spawned process rank `rank` of a torchrun-like environment."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)


def _spawn_ranks(
    target, config, *, world: int = 2, timeout: float = 300, start: str | None = None
) -> tuple[list, list]:
    """Runs `target(rank, world, port, overrides, queue)` in `world` processes (started by
    the multiprocessing method `start`) with the flattened `config`; returns what each put on
    the queue (in arrival order) and the exit codes.

    By default forked: the ranks share this process's imports (spawned ones import torch and
    deltalab again, each, seconds to a minute on two busy cores); each rank runs on one thread.
    A process that has initialized CUDA cannot fork children that touch it: they are spawned."""
    overrides = [f"{k}={v}" for k, v in _flatten(config.to_dict())]
    if start is None:
        start = "spawn" if torch.cuda.is_initialized() else "fork"
    context = mp.get_context(start)
    queue = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=target, args=(rank, world, port, overrides, queue))
        for rank in range(world)
    ]
    for p in processes:
        p.start()
    results = [queue.get(timeout=timeout) for _ in processes]
    for p in processes:
        p.join(timeout=60)
    return results, [p.exitcode for p in processes]


def _rank_main(rank: int, world: int, port: int, overrides: list[str], queue) -> None:
    _join(rank, world, port)
    result = train(load_run_config(None, overrides))
    queue.put((rank, result.losses))
    torch.distributed.destroy_process_group()


# DDP's ranks are spawned, as torchrun starts them: fresh interpreters that import deltalab
# themselves and inherit nothing from this process; every other multi-rank test forks its ranks.
@pytest.mark.parametrize(
    ("parallel", "start"), [("ddp", "spawn"), ("fsdp", None)], ids=["ddp-spawned", "fsdp"]
)
def test_two_gloo_processes_follow_the_single_process_loss_curve(tmp_path, corpus, parallel, start):
    single = train(run_config(tmp_path / "one", corpus))
    config = run_config(tmp_path / "two", corpus, f"train.parallel={parallel}")
    reports, exit_codes = _spawn_ranks(_rank_main, config, start=start)
    results = dict(reports)
    assert exit_codes == [0, 0]
    assert results[0] == results[1]
    assert torch.allclose(
        torch.tensor(results[0]), torch.tensor(single.losses), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_steps_split_over_two_context_parallel_ranks_have_the_one_process_losses(
    tmp_path, corpus, parallel, capfd
):
    # One window per step: two ranks can only share it by splitting its tokens.
    short = ("train.steps=2", "train.batch_size=1", "eval.every=2", "checkpoint.every=2")
    single = train(run_config(tmp_path / "one", corpus, *short))
    split = ("train.context_parallel=2", f"train.parallel={parallel}")
    config = run_config(tmp_path / "two", corpus, *short, *split)
    reports, exit_codes = _spawn_ranks(_rank_main, config)
    results = dict(reports)
    assert exit_codes == [0, 0]
    assert results[0] == results[1]
    assert torch.allclose(
        torch.tensor(results[0]), torch.tensor(single.losses), rtol=1e-5, atol=1e-6
    )
    # Each evaluation reads the one-process run's windows, which eval.batches asks for.
    assert "asks for more windows" not in capfd.readouterr().out


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, str]]:
    import json

    items = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "overrides":
            items.extend(_flatten(value, name + "."))
        else:
            items.append((name, json.dumps(value)))
    return items


def test_gradient_accumulation_and_recomputation_keep_the_loss_curve(
    tmp_path, corpus, monkeypatch, capsys
):
    """grad_accum=2 to rounding; activation checkpointing of the blocks and the recomputed FFN
    branches (which the run does compute again) bit for bit. With both set, the blocks are
    checkpointed whole (no FFN branch recomputed apart) and the run says the FFN setting does
    nothing."""
    import deltalab.models.lm as lm

    plain = train(run_config(tmp_path / "plain", corpus))
    accumulated = train(run_config(tmp_path / "accum", corpus, "train.grad_accum=2"))
    branches = []
    real = lm.recomputed
    monkeypatch.setattr(lm, "recomputed", lambda fn, *args: branches.append(fn) or real(fn, *args))
    capsys.readouterr()
    both = ("train.activation_checkpointing=true", "train.recompute_ffn=true")
    recomputed = train(run_config(tmp_path / "ckpt", corpus, *both))
    assert "train.recompute_ffn=true does nothing" in capsys.readouterr().out
    assert not branches
    ffn_recomputed = train(run_config(tmp_path / "ffn", corpus, "train.recompute_ffn=true"))
    assert branches
    assert torch.allclose(torch.tensor(accumulated.losses), torch.tensor(plain.losses), atol=1e-5)
    assert recomputed.losses == plain.losses
    assert ffn_recomputed.losses == plain.losses


def test_the_graphed_step_follows_the_eager_loss_curve_after_its_warmup_steps(
    tmp_path, corpus, monkeypatch, capsys
):
    """train.cuda_graphs without CUDA: the trainer takes the graph's path (two eager warmup
    steps, then every step through `StepGraph.step` on windows checked on the host, the
    gradients left set between steps) and the passes run eagerly: the loss curve of plain
    training bit for bit, with gradient accumulation and checkpointed blocks too. The replay is
    checked against eager steps on a GPU (tests/test_cuda.py)."""
    import deltalab.train.graphs as graphs
    import deltalab.train.loop as loop

    stepped, checked = [], []
    real_step, real_check = graphs.StepGraph.step, loop.check_token_ids
    monkeypatch.setattr(
        graphs.StepGraph, "step", lambda self, w: stepped.append(w.shape) or real_step(self, w)
    )
    monkeypatch.setattr(
        loop, "check_token_ids", lambda ids, v: checked.append(ids.device) or real_check(ids, v)
    )
    plain = train(run_config(tmp_path / "plain", corpus))
    capsys.readouterr()
    graphed = train(run_config(tmp_path / "graphs", corpus, "train.cuda_graphs=true"))
    assert "there are no CUDA graphs" in capsys.readouterr().out
    assert graphed.losses == plain.losses
    steps_after_warmup = 6 - graphs.WARMUP_STEPS
    assert stepped == [torch.Size([1, 4, 33])] * steps_after_warmup
    assert checked == [torch.device("cpu")] * steps_after_warmup
    stepped.clear()
    accumulated = train(run_config(tmp_path / "accum", corpus, "train.grad_accum=2"))
    graphed_accumulated = train(
        run_config(
            tmp_path / "accum_graphs", corpus, "train.grad_accum=2", "train.cuda_graphs=true"
        )
    )
    assert graphed_accumulated.losses == accumulated.losses
    assert stepped == [torch.Size([2, 2, 33])] * steps_after_warmup
    checkpointed = ("train.cuda_graphs=true", "train.activation_checkpointing=true")
    assert train(run_config(tmp_path / "ckpt_graphs", corpus, *checkpointed)).losses == plain.losses


def _failing_recording(monkeypatch, graphs) -> list[int]:
    """Every `StepGraph` made to record as on CUDA (no side stream), with a recording that
    fails as one reading a value back does; returns the list the failures are counted in."""
    failures = []
    real_init = graphs.StepGraph.__init__

    def on_cuda(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.on_cuda = True

    class FailingRecording:
        def __init__(self, graph, stream=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            failures.append(1)
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.StepGraph, "__init__", on_cuda)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", FailingRecording)
    return failures


def test_by_default_the_trainer_records_wherever_it_can_and_a_failed_recording_stops_the_run(
    tmp_path, corpus, monkeypatch, capsys
):
    """train.cuda_graphs null (the default): where no graph can record (CPU as it is) the run
    steps eagerly, the loss curve of train.cuda_graphs=false bit for bit and nothing said of
    graphs; where one can (made so on CPU) the run announces them and records at its third
    step, and a recording that fails (as one reading a value back does) stops the run naming
    train.cuda_graphs=false (a failed recording leaves the CUDA random generator unusable, so
    the run cannot go on eagerly)."""
    import deltalab.train.graphs as graphs

    plain = train(run_config(tmp_path / "plain", corpus, "train.cuda_graphs=false"))
    default = train(run_config(tmp_path / "default", corpus))
    assert default.losses == plain.losses
    assert "CUDA graphs" not in capsys.readouterr().out
    metrics = json.loads((tmp_path / "default" / "run" / "metrics.json").read_text())
    assert metrics["cuda_graphs"] is False
    failures = _failing_recording(monkeypatch, graphs)
    monkeypatch.setattr(graphs, "graphable", lambda config, ctx: True)
    with pytest.raises(RuntimeError, match=r"set train\.cuda_graphs=false to train eagerly"):
        train(run_config(tmp_path / "recorded", corpus))
    assert "CUDA graphs: each step after the first two replays" in capsys.readouterr().out
    assert failures == [1]


def test_graphs_are_recorded_in_one_process_and_asked_for_in_several_they_are_refused():
    """train.cuda_graphs decides whether a run's steps go through a StepGraph: by default
    wherever a run can record them (one CUDA process), and asked for in a run of several
    processes, whose gradient all-reduce no graph records, it is refused naming the setting."""
    from deltalab.errors import ConfigError
    from deltalab.train.distributed import Distributed
    from deltalab.train.graphs import records_steps

    one, two = (Distributed(0, n, 0, torch.device("cuda", 0)) for n in (1, 2))
    default, asked = load_run_config(None, []), load_run_config(None, ["train.cuda_graphs=true"])
    assert records_steps(default, one) and records_steps(asked, one)
    assert not records_steps(default, two)
    with pytest.raises(ConfigError, match=r"has 2 processes .*: set train\.cuda_graphs=false"):
        records_steps(asked, two)


@pytest.mark.parametrize("mixer", MIXER_KINDS)
def test_a_training_steps_passes_read_nothing_back_while_a_graph_records(mixer, monkeypatch):
    """What a CUDA graph's capture forbids, on CPU: with the value checks told a capture is
    under way (as `values_checkable` learns on a GPU), a training forward and backward of every
    mixer on its PyTorch paths reads no tensor's value back to the host (no `item`, `tolist`,
    `numpy`, `bool`, `float`, `int` or `__index__` of a tensor). The Triton paths the GPU records
    are checked there (tests/test_cuda.py)."""
    import deltalab.ops._checks as checks
    from deltalab.models import CausalLM, build_config

    torch.manual_seed(0)
    model = CausalLM(build_config("tiny", mixer=mixer, num_layers=2, chunk_size=16))
    ids = torch.randint(0, 256, (2, 33))
    monkeypatch.setattr(checks, "capturing", lambda x: True)
    for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):

        def refuse(self, *args, name=name, **kwargs):
            raise AssertionError(f"Tensor.{name}: a value read back during the capture")

        monkeypatch.setattr(torch.Tensor, name, refuse)
    loss = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], return_logits=False).loss
    loss.backward()
    monkeypatch.undo()
    assert torch.isfinite(loss) and all(
        p.grad is not None for n, p in model.named_parameters() if "embed" in n
    )


def test_a_non_finite_graphed_step_is_skipped_and_the_next_steps_start_afresh(
    tmp_path, corpus, monkeypatch
):
    """A NaN loss on a step taken through the graph's path (after the warmup) is skipped under
    train.nan_policy=skip, and the steps after it train as the same poisoned run does without
    the graph: nothing of the skipped step's gradients is carried into the next."""
    calls = poison_loss_at(monkeypatch, 4)
    eager = train(run_config(tmp_path / "eager", corpus, "train.nan_policy=skip"))
    calls["n"] = 0
    graphed = train(
        run_config(tmp_path / "graphs", corpus, "train.nan_policy=skip", "train.cuda_graphs=true")
    )
    assert len(graphed.losses) == 5 and all(math.isfinite(x) for x in graphed.losses)
    assert graphed.losses == eager.losses


def test_a_stop_signal_checkpoints_and_the_run_resumes_bit_for_bit(tmp_path, corpus, monkeypatch):
    reference = train(run_config(tmp_path / "a", corpus))
    original = torch.optim.AdamW.step
    calls = {"n": 0}

    # A real SIGTERM to this process right after the second optimizer step (the scheduler wraps
    # the optimizer's step when it is built, so the class is patched before the run starts).
    def step(optimizer, *args, **kwargs):
        result = original(optimizer, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    stopped = train(run_config(tmp_path / "b", corpus))
    monkeypatch.undo()
    assert stopped.interrupted and len(stopped.losses) == 2
    assert stopped.stop_signal == signal.SIGTERM
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "run")] == ["step_00000002.pt"]
    interrupted = _metrics(tmp_path / "b" / "run")
    assert (interrupted["status"], interrupted["steps_done"], interrupted["steps_planned"]) == (
        "interrupted",
        2,
        6,
    )
    resumed = train(run_config(tmp_path / "b", corpus, "checkpoint.resume=true"))
    assert resumed.losses == reference.losses
    assert _metrics(tmp_path / "b" / "run")["status"] == "completed"
    assert _metrics(tmp_path / "b" / "run")["steps_done"] == 6


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_by_a_signal_exits_non_zero(tmp_path, corpus, monkeypatch, signum, status):
    from deltalab.cli import main

    original = torch.optim.AdamW.step

    def step(optimizer, *args, **kwargs):
        result = original(optimizer, *args, **kwargs)
        os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    overrides = [f"{k}={v}" for k, v in _flatten(run_config(tmp_path, corpus).to_dict())]
    assert main(["train", *overrides]) == status
    assert _metrics(tmp_path / "run")["status"] == "interrupted"


def test_tensorboard_events_are_written_when_enabled(tmp_path, corpus):
    pytest.importorskip("tensorboard")
    train(run_config(tmp_path, corpus, "log.tensorboard=true"))
    assert any((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_a_skipped_last_step_still_writes_the_final_checkpoint(tmp_path, corpus, monkeypatch):
    poison_loss_at(monkeypatch, 6)
    result = train(run_config(tmp_path, corpus, "train.nan_policy=skip"))
    assert len(result.losses) == 5
    names = [p.name for p in list_checkpoints(tmp_path / "run")]
    assert names[-1] == "step_00000006.pt"


def test_a_new_run_refuses_a_directory_with_checkpoints_and_resume_refuses_a_changed_config(
    tmp_path, corpus
):
    train(run_config(tmp_path, corpus))
    with pytest.raises(ValueError, match=r"already holds checkpoints of a run; continue it with"):
        train(run_config(tmp_path, corpus, "optim.lr=0.001"))
    with pytest.raises(ValueError, match=r"the run config changed \(optim.lr: 0.01 -> 0.001\)"):
        train(run_config(tmp_path, corpus, "optim.lr=0.001", "checkpoint.resume=true"))


def test_run_directories_inside_the_data_source_are_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"log.out_dir .* lies inside data.source"):
        train(run_config(tmp_path, corpus, f"log.out_dir={corpus}/run"))


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


def test_a_run_with_a_local_tokenizer_exports_it_for_generate(tmp_path, corpus, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from deltalab.cli import main

    raw = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    raw.train_from_iterator(["def item_1 = value(2)", "return self"] * 30, trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(tmp_path / "tok")
    train(run_config(tmp_path, corpus, f"data.tokenizer={tmp_path / 'tok'}"))
    assert (tmp_path / "run" / "model" / "tokenizer_config.json").exists()
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run" / "model"), "def", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def")


def _failing_rank_main(rank: int, world: int, port: int, overrides: list[str], queue) -> None:
    _join(rank, world, port)
    try:
        train(load_run_config(None, overrides))
    except Exception as error:
        queue.put((rank, type(error).__name__, str(error)))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_data_error_on_rank_0_stops_every_rank(tmp_path, corpus):
    # A document rank 0 cannot read: it fails while tokenizing, the others wait for its tokens.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.jsonl").write_text('{"title": "no text field"}\n')
    config = run_config(tmp_path, str(bad))
    reports, _ = _spawn_ranks(_failing_rank_main, config, timeout=120)
    errors = {rank: (kind, text) for rank, kind, text in reports}
    # A user error: every rank reports one, which the CLI prints as one line.
    assert errors[0][0] == "DataError" and "text" in errors[0][1]
    assert errors[1] == (
        "DataError",
        "rank 0 could not prepare the training data; see its error",
    )


@pytest.mark.parametrize(
    ("checkpointing", "mixer"), [(False, "gdn"), (False, "kdn_diag"), (True, "gdn")]
)
def test_a_training_forwards_value_checks_read_back_once_unless_checkpointing(
    tmp_path, corpus, monkeypatch, checkpointing, mixer
):
    """Inside a training step's forward every value check is queued in the trainer's block
    (read back together at its end, one host read instead of one per layer); with activation
    checkpointing, which a check held to the forward's end would undercut (it keeps its input
    alive), none is: each is read at once or at the end of the op that made it."""
    import deltalab.train.loop as loop
    from deltalab.ops import _checks

    counts = {True: 0, False: 0}  # not held by the trainer's block -> how many
    in_training = {True: 0, False: 0}
    failed, loss_of = _checks._failed, loop._loss
    trainer_block = []

    def counting(x, kind, passed, check):
        block = _checks._QUEUED.get()
        counts[block is None or block is not trainer_block[-1]] += 1
        return failed(x, kind, passed, check)

    def loss(model, window, autocast):
        trainer_block.append(_checks._QUEUED.get())  # the trainer's block, or None
        before = dict(counts)
        out = loss_of(model, window, autocast)
        if model.training:
            for now in counts:
                in_training[now] += counts[now] - before[now]
        return out

    monkeypatch.setattr(_checks, "_failed", counting)
    monkeypatch.setattr(loop, "_loss", loss)
    train(run_config(tmp_path, corpus, f"model.mixer={mixer}",
                     f"train.activation_checkpointing={str(checkpointing).lower()}"))  # fmt: skip
    # Without checkpointing every one is held by the trainer's block, with it none.
    assert in_training[checkpointing] > 0
    assert in_training[not checkpointing] == 0
