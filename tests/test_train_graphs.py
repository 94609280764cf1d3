"""deltalab train with CUDA graphs (train.cuda_graphs), on CPU: the graph's path follows the eager
loss curve after its warmup steps, the default records wherever a run can and a failed recording
stops the run, runs of several processes refuse graphs, a training step's passes read nothing
back while a graph records, and a non-finite graphed step is skipped, the next steps starting
afresh. The replay itself is checked on a GPU (tests/test_cuda.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_train import poison_loss_at, run_config

from deltalab.models import MIXER_KINDS
from deltalab.train import load_run_config, train


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
