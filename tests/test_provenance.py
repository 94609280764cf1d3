"""Provenance: what a run records of its code, packages, device and data; pinned data sources
(archives and file lists); a study's refusal to mix records of different commits."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import subprocess
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from conftest import make_corpus
from test_study import FakeTrain, micro_spec, plan_of, quiet, write_corpus
from test_train import run_config

from deltalab.cli import main
from deltalab.data import (
    ByteTokenizer,
    CorpusConfig,
    archive_stdlib,
    iter_documents,
    prepare_tokens,
    source_fingerprint,
)
from deltalab.errors import ConfigError
from deltalab.ops._triton import TRITON_VERSION
from deltalab.provenance import (
    ARCHIVE_COMMIT,
    DISTRIBUTIONS,
    archive_commit,
    code_identity,
    code_version,
    installed_version,
    package_versions,
)
from deltalab.study.cli import execute
from deltalab.study.report import collect
from deltalab.train import train

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


# --- what a training run records -----------------------------------------------------------------


def test_a_training_run_records_its_commit_versions_device_and_data_hashes(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    train(run_config(tmp_path, corpus, "train.steps=2", "eval.sample_tokens=0"))
    record = json.loads((tmp_path / "run" / "provenance.json").read_text())
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["provenance"] == record
    assert record["code"] == {
        "from": "git",
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }
    assert {"python", "torch", "triton", "transformers", "deltalab"} <= set(record["versions"])
    assert record["device"] == "cpu"
    for split in ("train", "held_out"):
        entry = record["data"][split]
        (shards,) = (tmp_path / "cache").glob(f"corpus-{split}-*")
        stream = b"".join(p.read_bytes() for p in sorted(shards.glob("shard_*.bin")))
        assert entry["tokens_sha256"] == hashlib.sha256(stream).hexdigest()
        # Byte tokens: one per UTF-8 byte, plus one EOS per document.
        assert entry["tokens"] == entry["text_bytes"] + entry["documents"]


def test_a_package_outside_a_git_checkout_is_recorded_by_its_installed_version(tmp_path):
    outside = tmp_path / "site-packages" / "deltalab"
    outside.mkdir(parents=True)
    code = code_version(outside)
    assert code["from"] == "installed" and "commit" not in code
    assert code_identity(code) == f"deltalab {code['version']} (installed)"
    # A repository around the folder is not the package's checkout unless deltalab/ is its own.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert code_version(tmp_path / "site-packages" / "deltalab")["from"] == "installed"


def test_a_tree_written_by_git_archive_records_the_commit_it_was_written_from(tmp_path):
    head = git("rev-parse", "HEAD")
    if not head:
        pytest.skip("the tests do not run from a git checkout")
    # The tree of HEAD as `git archive` writes it: no .git, the commit stamped in by git.
    archive = subprocess.run(
        ["git", "archive", "--format=tar", "HEAD", "deltalab"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="data")
    code = code_version(tmp_path / "deltalab")
    assert code == {"from": "archive", "commit": head}
    # The same commit from a checkout or from an archive of it is the same code to a study.
    assert code_identity(code) == code_identity({"from": "git", "commit": head, "dirty": False})
    assert archive_commit(tmp_path / "deltalab") == head


def test_an_unstamped_or_foreign_archive_file_is_not_taken_for_a_commit(tmp_path):
    package = tmp_path / "deltalab"
    package.mkdir()
    # The placeholder as the repository holds it (a wheel built from a checkout carries it).
    (package / ARCHIVE_COMMIT).write_text((ROOT / "deltalab" / ARCHIVE_COMMIT).read_text())
    assert archive_commit(package) is None
    assert code_version(package)["from"] == "installed"
    for text in ("0123abc\n", "g" * 40, "A" * 40, ""):
        (package / ARCHIVE_COMMIT).write_text(text)
        assert archive_commit(package) is None, text
    (package / ARCHIVE_COMMIT).write_text("ab" * 20 + "\n")
    assert archive_commit(package) == "ab" * 20
    # code_version is cached per folder (a process's code does not change): a fresh one.
    stamped = tmp_path / "stamped" / "deltalab"
    stamped.mkdir(parents=True)
    (stamped / ARCHIVE_COMMIT).write_text("ab" * 20 + "\n")
    assert code_version(stamped) == {"from": "archive", "commit": "ab" * 20}


def test_a_package_installed_under_another_distribution_name_is_recorded_by_that_version():
    # PyTorch's nightly, ROCm and XPU builds install the `triton` module as `pytorch-triton*`.
    assert set(DISTRIBUTIONS["triton"]) >= {"triton", "pytorch-triton", "pytorch-triton-rocm"}
    torch_version = metadata.version("torch")
    assert installed_version("not-installed", ("not-installed", "torch")) == torch_version
    assert installed_version("not-installed") is None
    assert installed_version("not-installed", ()) is None
    assert package_versions()["triton"] == TRITON_VERSION
    # package_versions reads a package under each of its distributions' names.
    moved = package_versions(distributions={"triton": ("not-installed", "torch")})
    assert moved["triton"] == torch_version


# --- pinned data sources --------------------------------------------------------------------------


def test_an_archive_of_the_stdlib_reads_the_same_documents_split_and_order_as_the_stdlib(
    tmp_path,
):
    archive = archive_stdlib(tmp_path / "stdlib.tar.gz")
    for split in ("train", "held_out"):
        built_in = CorpusConfig(split=split, max_bytes=200_000)
        pinned = CorpusConfig(source=str(archive), split=split, max_bytes=200_000)
        assert list(iter_documents(pinned)) == list(iter_documents(built_in))


def write_documents(folder: Path) -> dict[str, str]:
    texts = {f"sub/doc_{i:02d}.py": f"x_{i} = {i}\n" * (i + 1) for i in range(30)}
    for name, text in texts.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return texts


def test_a_file_list_a_tar_and_a_zip_of_the_same_files_give_the_same_documents(tmp_path):
    texts = write_documents(tmp_path / "files")
    (tmp_path / "files.txt").write_text("# the corpus\n\n" + "\n".join(texts) + "\n")
    (tmp_path / "files" / "files.txt").write_text("\n".join(texts) + "\n")
    with tarfile.open(tmp_path / "files.tar", "w") as archive:
        for name in texts:
            archive.add(tmp_path / "files" / name, arcname=f"./{name}")
    with zipfile.ZipFile(tmp_path / "files.zip", "w") as archive:
        for name in texts:
            archive.write(tmp_path / "files" / name, arcname=name)
    sources = [f"@{tmp_path / 'files' / 'files.txt'}", str(tmp_path / "files.tar")]
    sources.append(str(tmp_path / "files.zip"))
    for split in ("train", "held_out"):
        found = [
            list(iter_documents(CorpusConfig(source=s, split=split, held_out_fraction=0.3)))
            for s in sources
        ]
        assert found[0] == found[1] == found[2] and found[0]
    everything = CorpusConfig(source=sources[1], split="all", max_bytes=None)
    assert sorted(iter_documents(everything)) == sorted(texts.values())


def test_a_changed_member_of_a_pinned_source_changes_its_recorded_fingerprints(tmp_path):
    texts = write_documents(tmp_path / "files")
    listing = tmp_path / "files" / "list.txt"
    listing.write_text("\n".join(texts) + "\n")
    config = CorpusConfig(source=f"@{listing}", split="all")
    before = prepare_tokens(config, ByteTokenizer(), tmp_path / "cache").manifest.fingerprint()
    source_before = source_fingerprint(config)
    (tmp_path / "files" / "sub" / "doc_03.py").write_text("changed = True\n")
    after = prepare_tokens(config, ByteTokenizer(), tmp_path / "cache").manifest.fingerprint()
    assert source_fingerprint(config) != source_before
    assert after["tokens_sha256"] != before["tokens_sha256"]
    assert after["text_sha256"] != before["text_sha256"]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("@{tmp}/missing.txt", "the file list '{tmp}/missing.txt' is not an existing file"),
        ("{tmp}/missing.tar.gz", "the archive '{tmp}/missing.tar.gz' is not an existing file"),
        ("@{tmp}/list.txt", "list.txt:2: 'gone.py' is not an existing file"),
    ],
)
def test_a_pinned_source_that_cannot_be_read_is_refused_naming_the_file(tmp_path, source, message):
    (tmp_path / "here.py").write_text("x = 1\n")
    (tmp_path / "list.txt").write_text("here.py\ngone.py\n")
    with pytest.raises(ValueError, match=message.format(tmp=tmp_path).replace(".", r"\.")):
        list(iter_documents(CorpusConfig(source=source.format(tmp=tmp_path), split="all")))


# --- the study's records ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def finished_study(tmp_path: Path, corpus: Path) -> tuple[dict, Path]:
    spec = micro_spec(tmp_path, corpus)
    plan = plan_of(spec)
    assert execute(plan, launcher=FakeTrain({r.name: 1.0 for r in plan.runs}), say=quiet) == 0
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return spec, path


def rewrite_records(spec: dict, names: list[str], **provenance) -> None:
    for name in names:
        path = Path(spec["out_dir"]) / "runs" / name / "study_run.json"
        record = json.loads(path.read_text())
        record["provenance"].update(copy.deepcopy(provenance))
        path.write_text(json.dumps(record))


OTHER = {"from": "git", "commit": "0123456789ab" + "0" * 28, "dirty": False}


def test_a_study_refuses_to_resume_into_records_of_another_commit_unless_told(tmp_path, corpus):
    spec, _ = finished_study(tmp_path, corpus)
    records = Path(spec["out_dir"]) / "runs"
    record = json.loads((records / "gdn2.tiny.lr0.003.s0" / "study_run.json").read_text())
    assert record["provenance"]["code"] == code_version()
    rewrite_records(spec, ["gdn2.tiny.lr0.003.s0"], code=OTHER)
    current = code_identity(code_version())[:12]
    with pytest.raises(ConfigError) as refused:
        execute(plan_of(spec), launcher=FakeTrain({}), say=quiet)
    message = str(refused.value)
    assert "\n" not in message and "0123456789ab (gdn2.tiny.lr0.003.s0)" in message
    assert f"than this study's {current}" in message and "--allow-mixed-commits" in message
    launcher = FakeTrain({})
    assert execute(plan_of(spec), launcher=launcher, say=quiet, allow_mixed_commits=True) == 0


def test_aggregate_only_refuses_records_of_two_commits_in_one_line_naming_them(
    tmp_path, corpus, capsys
):
    spec, path = finished_study(tmp_path, corpus)
    rewrite_records(spec, ["gdn2.tiny.lr0.003.s0", "gdn2.tiny.lr0.003.s1"], code=OTHER)
    assert main(["study", str(path), "--aggregate-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "records of 2 different commits" in err, err
    assert "0123456789ab (gdn2.tiny.lr0.003.s0, gdn2.tiny.lr0.003.s1)" in err, err
    assert main(["study", str(path), "--aggregate-only", "--allow-mixed-commits"]) == 0


def test_the_report_names_the_device_the_records_name_not_the_planning_machines(tmp_path, corpus):
    spec, path = finished_study(tmp_path, corpus)
    names = [p.name for p in (Path(spec["out_dir"]) / "runs").iterdir()]
    rewrite_records(spec, names, device="cuda: NVIDIA H100 80GB HBM3")
    assert main(["study", str(path), "--aggregate-only"]) == 0
    assert collect(plan_of(spec))["device"] == "cuda: NVIDIA H100 80GB HBM3"
    markdown = (Path(spec["out_dir"]) / "study.md").read_text()
    assert "trained on cuda: NVIDIA H100 80GB HBM3 (their records)" in markdown
    assert "device cpu" not in markdown and "trained on cpu" not in markdown


def fake_trained_data(spec: dict, names: list[str], train_sha: str) -> None:
    """Gives the runs `names` a trainer's provenance.json naming train tokens `train_sha`."""
    for name in names:
        data = {"train": {"tokens_sha256": train_sha}, "held_out": {"tokens_sha256": "b" * 64}}
        path = Path(spec["out_dir"]) / "runs" / name / "provenance.json"
        path.write_text(json.dumps({"code": code_version(), "data": data}))


def test_a_study_refuses_runs_trained_on_other_data_than_its_source_gives(tmp_path, corpus):
    spec, _ = finished_study(tmp_path, corpus)
    fake_trained_data(spec, ["gdn2.tiny.lr0.003.s0"], "a" * 64)
    with pytest.raises(ConfigError) as refused:
        execute(plan_of(spec), launcher=FakeTrain({}), say=quiet)
    message = str(refused.value)
    assert "\n" not in message and "records of other data" in message
    assert "aaaaaaaaaaaa/bbbbbbbbbbbb (gdn2.tiny.lr0.003.s0)" in message
    assert execute(plan_of(spec), launcher=FakeTrain({}), say=quiet, allow_mixed_data=True) == 0


def test_aggregate_only_refuses_runs_of_two_token_streams(tmp_path, corpus, capsys):
    spec, path = finished_study(tmp_path, corpus)
    fake_trained_data(spec, ["gdn2.tiny.lr0.003.s0"], "a" * 64)
    fake_trained_data(spec, ["gdn2.tiny.lr0.003.s1"], "c" * 64)
    assert main(["study", str(path), "--aggregate-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "records of 2 different data" in err, err
    assert main(["study", str(path), "--aggregate-only", "--allow-mixed-data"]) == 0


def test_a_resumed_run_keeps_the_commits_of_its_earlier_starts(tmp_path):
    from deltalab.provenance import record_identities, write_run_provenance

    (tmp_path / "provenance.json").write_text(json.dumps({"code": OTHER}))
    record = write_run_provenance(tmp_path, "cpu", {})
    assert record["earlier_code"] == [OTHER]
    assert record_identities(record) == [code_identity(code_version()), OTHER["commit"]]
    # The same code again adds nothing.
    again = write_run_provenance(tmp_path, "cpu", {})
    assert again["earlier_code"] == [OTHER]


def test_a_run_trains_on_a_file_list_and_records_the_list_as_its_source(tmp_path):
    texts = write_documents(tmp_path / "files")
    for i in range(30, 60):
        name = f"sub/doc_{i:02d}.py"
        (tmp_path / "files" / name).write_text(f"value_{i} = {i} * {i}\n" * 12)
        texts[name] = ""
    listing = tmp_path / "files" / "list.txt"
    listing.write_text("\n".join(texts) + "\n")
    extra = ["train.steps=2", "eval.sample_tokens=0"]
    train(run_config(tmp_path, f"@{listing}", *extra))
    record = json.loads((tmp_path / "run" / "provenance.json").read_text())
    assert record["data"]["train"]["source"] == f"@{listing} (train)"
    assert record["data"]["held_out"]["documents"] > 0
