"""deltalab export (checkpoint -> Hugging Face directory) and model.init_from (the way back)."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_train import run_config, run_overrides

from deltalab.cli import main
from deltalab.errors import CheckpointError, ConfigError
from deltalab.train import train
from deltalab.train.checkpoint import list_checkpoints
from deltalab.train.export import export_checkpoint, save_model_directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    folder = tmp_path_factory.mktemp("trained")
    result = train(run_config(folder, corpus, "eval.sample_tokens=0"))
    return folder, result


def same_logits(a, b) -> bool:
    """Whether the Hugging Face directories a and b give the same logits on random tokens."""
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(p)(tokens).logits for p in (a, b)]
    return torch.equal(*logits)


def test_an_exported_checkpoint_gives_the_trained_models_logits(tmp_path, trained, capsys):
    folder, _ = trained
    run = folder / "run"
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    assert "step_00000006.pt" in capsys.readouterr().out
    assert same_logits(tmp_path / "out", run / "model")
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    # An older checkpoint by its path: the weights after step 3, not the final ones.
    older = list_checkpoints(run)[0]
    assert main(["export", str(older), str(tmp_path / "older")]) == 0
    assert not same_logits(tmp_path / "older", run / "model")


def test_a_model_directory_is_replaced_whole_or_not_at_all(tmp_path, trained):
    """A save that fails part way (here the tokenizer's files, after the weights) leaves the
    directory as it was, or absent, and no partial sibling; a save that completes replaces it."""
    from deltalab.data import ByteTokenizer
    from deltalab.models import CausalLM

    folder, _ = trained
    model = CausalLM.from_pretrained(folder / "run" / "model")
    out = tmp_path / "model"
    save_model_directory(model, ByteTokenizer(), out)
    files = sorted(p.name for p in out.iterdir())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    for target in (out, tmp_path / "never"):
        with pytest.raises(TypeError, match="save_pretrained"):
            save_model_directory(model, object(), target)
    assert sorted(p.name for p in out.iterdir()) == files
    assert same_logits(out, folder / "run" / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    save_model_directory(model, ByteTokenizer(), out)
    assert not same_logits(out, folder / "run" / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_model_directory_save_follows_links_fills_empty_folders_and_clears_leftovers(
    tmp_path, trained
):
    """A link to a directory is replaced through (the link stays, its target holds the new
    model); an empty `out` is written into (its inode kept); a `.NAME.previous` left by a save
    stopped between its two renames is removed by the next save."""
    from deltalab.data import ByteTokenizer
    from deltalab.models import CausalLM

    folder, _ = trained
    model = CausalLM.from_pretrained(folder / "run" / "model")
    target, link = tmp_path / "disk" / "model", tmp_path / "model"
    save_model_directory(model, ByteTokenizer(), target)
    link.symlink_to(target, target_is_directory=True)
    stale = tmp_path / "disk" / ".model.previous"
    stale.mkdir()
    (stale / "model.safetensors").write_text("left by a killed save")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_model_directory(model, ByteTokenizer(), link)
    assert link.is_symlink() and not same_logits(link, folder / "run" / "model")
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["model"]
    empty = tmp_path / "empty"
    empty.mkdir()
    inode = empty.stat().st_ino
    save_model_directory(model, ByteTokenizer(), empty)
    assert empty.stat().st_ino == inode and same_logits(empty, link)


def test_export_refuses_an_incomplete_checkpoint_and_a_used_out(tmp_path, trained, capsys):
    import shutil

    folder, _ = trained
    run = tmp_path / "run"
    shutil.copytree(folder / "run", run)
    newest = list_checkpoints(run)[-1]
    newest.with_name(newest.name + ".sha256").unlink()
    with pytest.raises(CheckpointError, match=r"cannot export .*step_00000006\.pt.*missing digest"):
        export_checkpoint(newest, tmp_path / "out")
    assert main(["export", str(newest), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(CheckpointError, match=r"OUT .* is not an empty directory"):
        export_checkpoint(run, run)


def test_a_run_started_from_an_exported_model_starts_at_its_loss(tmp_path, trained, corpus):
    folder, source = trained
    out = tmp_path / "out"
    main(["export", str(folder / "run"), str(out)])
    seeded = train(run_config(tmp_path, corpus, f"model.init_from={out}", "eval.sample_tokens=0"))
    assert seeded.initial_perplexity == source.final_perplexity


def test_a_seeded_run_resumes_from_its_checkpoint_after_its_seed_is_gone(tmp_path, trained, corpus):
    folder, _ = trained
    out = tmp_path / "out"
    main(["export", str(folder / "run"), str(out)])
    settings = (f"model.init_from={out}", "eval.sample_tokens=0")
    whole = train(run_config(tmp_path, corpus, *settings))
    # Back to step 3: the later checkpoint gone, then the seed directory too.
    for path in list_checkpoints(tmp_path / "run")[1:]:
        path.unlink()
    shutil.rmtree(out)
    resumed = train(run_config(tmp_path, corpus, *settings, "checkpoint.resume=true"))
    assert resumed.final_perplexity == pytest.approx(whole.final_perplexity, rel=1e-5)
    # Dropping the vanished seed from the config on resume is allowed too.
    again = train(run_config(tmp_path, corpus, "eval.sample_tokens=0", "checkpoint.resume=true"))
    assert again.final_perplexity == pytest.approx(whole.final_perplexity, rel=1e-5)


def test_init_from_a_model_of_other_shapes_names_the_differing_field(tmp_path, trained, corpus):
    folder, _ = trained
    wider = run_config(
        tmp_path,
        corpus,
        f"model.init_from={folder / 'run' / 'model'}",
        "model.overrides={hidden_size: 64, num_layers: 2, num_heads: 2, head_dim: 16, "
        "chunk_size: 16}",
    )
    with pytest.raises(ConfigError, match=r"hidden_size is 32 there, 64 here") as caught:
        train(wider)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"model\.init_from=.* \(no config\.json\)"):
        train(run_config(tmp_path, corpus, f"model.init_from={tmp_path}"))


def test_export_and_train_print_no_transformers_bars_and_leave_them_on_for_the_caller(
    tmp_path, trained, corpus, capsys
):
    from transformers.utils import logging as transformers_logging

    folder, _ = trained
    out = tmp_path / "out"
    assert main(["export", str(folder / "run"), str(out)]) == 0
    seeded = run_overrides(tmp_path, corpus, f"model.init_from={out}", "train.steps=2")
    assert main(["train", *seeded, "eval.sample_tokens=0"]) == 0
    err = capsys.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err
    # The commands silence transformers for their own work only: a program that imported
    # deltalab keeps its bars.
    assert transformers_logging.is_progress_bar_enabled()
