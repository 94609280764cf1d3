"""The data layer: tokenizer round trips, shard files and their cache, corpora, the sampler."""

from __future__ import annotations

import json
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from deltalab.data import (
    MANIFEST_NAME,
    STDLIB_SOURCE,
    ByteTokenizer,
    CorpusConfig,
    PackedSequences,
    ResumableSampler,
    Tokenizer,
    batches,
    build_shards,
    in_split,
    iter_documents,
    load_tokenizer,
    open_shards,
    prepare_tokens,
    read_parquet,
    save_tokenizer,
    stdlib_files,
)
from deltalab.data import shards as shards_module
from deltalab.data.corpus import STDLIB_EXCLUDED_DIRS, read_hf_dataset
from deltalab.errors import DataError

TEXTS = [
    "plain ASCII, with punctuation: {}[]()!\n\ttabs too",
    "Grüße aus Köln — naïve café",
    "東京タワー と 🙂🚀 emoji",
    "combining: e\u0301, zero\x00byte, surrogate-free 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]
DOCUMENTS = ["first document\n", "zweites Dokument: Grüße", "三", "a" * 40, "last 🙂"]
# Small enough that every test reads a few dozen stdlib files at most.
SMALL_STDLIB = 150_000


def token_stream(tokenizer: Tokenizer, documents: list[str]) -> list[int]:
    """What the shards must hold: each document's tokens, then EOS."""
    return [t for d in documents for t in [*tokenizer.encode(d), tokenizer.eos_id]]


def write_text_corpus(root: Path) -> Path:
    root.mkdir()
    (root / "a.txt").write_text("alpha document\n", encoding="utf-8")
    (root / "b.txt").write_text("beta: Grüße\n", encoding="utf-8")
    return root


class WideTokenizer:
    """A tokenizer whose ids go past uint16: code point + 60000, EOS the last id."""

    spec = "wide-test"
    vocab_size = 70_000
    bos_id = pad_id = eos_id = 69_999

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 60_000 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i - 60_000) for i in ids if i != self.eos_id)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_decode_inverts_encode_for_ascii_and_non_ascii(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_specials_follow_the_bytes_and_are_dropped_or_rendered():
    tokenizer = ByteTokenizer()
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (256, 257, 258)
    assert tokenizer.vocab_size == 259
    assert isinstance(tokenizer, Tokenizer)
    ids = [tokenizer.bos_id, *tokenizer.encode("hé"), tokenizer.eos_id, tokenizer.pad_id]
    assert tokenizer.decode(ids) == "hé"
    assert tokenizer.decode(ids, render_special=True) == "<|bos|>hé<|eos|><|pad|>"


def test_byte_decode_replaces_a_cut_multibyte_character():
    tokenizer = ByteTokenizer()
    cut = tokenizer.encode("é")[:1] + tokenizer.encode("x")
    assert tokenizer.decode(cut) == "\ufffdx"


def test_byte_decode_refuses_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"ids\[1\] = 259 .* 0 <= id < 259"):
        ByteTokenizer().decode([65, 259])


@pytest.fixture(scope="module")
def exported_byte_tokenizer(tmp_path_factory):
    """The byte tokenizer as written to a model directory, loaded back by AutoTokenizer."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("byte_tokenizer")
    save_tokenizer(ByteTokenizer(), path)
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.mark.parametrize("text", [*TEXTS, "literal specials <|bos|><|eos|><|pad|> stay bytes"])
def test_exported_byte_tokenizer_encodes_and_decodes_exactly_as_the_byte_tokenizer(
    exported_byte_tokenizer, text
):
    ids = exported_byte_tokenizer.encode(text, add_special_tokens=False)
    assert ids == ByteTokenizer().encode(text)
    assert exported_byte_tokenizer.decode(ids, skip_special_tokens=True) == text
    # The call pipelines make (add_special_tokens left at its default) adds nothing either.
    assert exported_byte_tokenizer(text)["input_ids"] == ids


def test_exported_byte_tokenizer_has_the_byte_tokenizers_specials_and_size(
    exported_byte_tokenizer,
):
    byte = ByteTokenizer()
    assert len(exported_byte_tokenizer) == byte.vocab_size
    for name in ("bos", "eos", "pad"):
        assert getattr(exported_byte_tokenizer, f"{name}_token_id") == getattr(byte, f"{name}_id")
    special_ids = [byte.bos_id, byte.eos_id, byte.pad_id]
    assert exported_byte_tokenizer.convert_ids_to_tokens(special_ids) == list(byte.SPECIAL_TOKENS)


def test_exported_byte_tokenizer_decodes_any_ids_as_the_byte_tokenizer(exported_byte_tokenizer):
    # Random ids biased to UTF-8 lead and continuation bytes: cut and invalid sequences, with
    # specials dropped from the middle of a character, must give the same U+FFFD replacements.
    rng = np.random.default_rng(0)
    byte = ByteTokenizer()
    pools = [np.arange(259), np.arange(0x80, 0xC0), np.arange(0xC0, 0xF8), np.arange(256, 259)]
    for _ in range(500):
        ids = [int(rng.choice(pools[rng.integers(4)])) for _ in range(rng.integers(1, 10))]
        decoded = exported_byte_tokenizer.decode(ids, skip_special_tokens=True)
        assert decoded == byte.decode(ids), ids


def test_save_tokenizer_refuses_a_tokenizer_without_save_pretrained(tmp_path):
    with pytest.raises(TypeError, match=r"save_pretrained\(path\).*WideTokenizer"):
        save_tokenizer(WideTokenizer(), tmp_path)


def test_load_tokenizer_byte_and_refusals(tmp_path, monkeypatch):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="nowhere"):
        load_tokenizer(missing)
    # None in sys.modules makes `import transformers` fail whether it is installed or not.
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        load_tokenizer(str(tmp_path))


def test_shards_hold_the_documents_with_separators_across_shard_boundaries(tmp_path):
    tokenizer = ByteTokenizer()
    manifest = build_shards(DOCUMENTS, tokenizer, tmp_path / "s", shard_tokens=16)
    shards = open_shards(tmp_path / "s")
    expected = np.array(token_stream(tokenizer, DOCUMENTS))
    assert len(shards) == manifest.num_tokens == expected.size
    assert len(manifest.shard_files) == -(-expected.size // 16)
    assert all(n == 16 for n in manifest.shard_tokens[:-1])
    assert manifest.num_documents == len(DOCUMENTS)
    assert manifest.dtype == "uint16" and manifest.vocab_size == 259
    np.testing.assert_array_equal(shards[:], expected)
    # Reads that start and end inside different shards.
    np.testing.assert_array_equal(shards[5:50], expected[5:50])
    assert shards[-1] == tokenizer.eos_id and shards[17] == expected[17]
    ends = np.flatnonzero(shards[:] == tokenizer.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    decoded = [tokenizer.decode(shards[s:e]) for s, e in zip(starts, ends, strict=True)]
    assert decoded == DOCUMENTS


def test_manifest_json_lists_dtype_vocab_tokenizer_and_counts(tmp_path):
    build_shards(DOCUMENTS, ByteTokenizer(), tmp_path, source="docs", source_fingerprint="f00")
    record = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert record["dtype"] == "uint16" and record["vocab_size"] == 259
    assert record["tokenizer"] == "byte" and record["eos_id"] == 257
    assert record["source"] == "docs" and record["source_fingerprint"] == "f00"
    assert record["num_tokens"] == sum(record["shard_tokens"])
    assert record["num_documents"] == len(DOCUMENTS)


def test_vocabularies_past_uint16_are_stored_as_uint32(tmp_path):
    tokenizer = WideTokenizer()
    build_shards(["ab", "€"], tokenizer, tmp_path)
    shards = open_shards(tmp_path)
    assert shards.dtype == np.uint32
    assert shards[:].tolist() == token_stream(tokenizer, ["ab", "€"])


def test_build_refuses_ids_outside_the_vocabulary(tmp_path):
    class Broken(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            return [300]

    with pytest.raises(ValueError, match=r"ids in \[300, 300\], expected ids in \[0, 259\)"):
        build_shards(["x"], Broken(), tmp_path)


def test_interrupted_build_leaves_no_manifest(tmp_path):
    build_shards(DOCUMENTS, ByteTokenizer(), tmp_path, shard_tokens=8)
    assert (tmp_path / MANIFEST_NAME).is_file()

    def failing() -> Iterator[str]:
        yield from DOCUMENTS[:3]
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        build_shards(failing(), ByteTokenizer(), tmp_path, shard_tokens=8)
    # The complete earlier set was invalidated before the new shards were written.
    assert not (tmp_path / MANIFEST_NAME).exists()
    with pytest.raises(ValueError, match=r"has no manifest\.json"):
        open_shards(tmp_path)


def test_open_shards_refuses_a_truncated_shard(tmp_path):
    manifest = build_shards(DOCUMENTS, ByteTokenizer(), tmp_path, shard_tokens=16)
    shard = tmp_path / manifest.shard_files[0]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"must hold 16 tokens \(32 bytes\).*got 30 bytes"):
        open_shards(tmp_path)


def test_token_shards_pickle_by_path_not_by_contents(tmp_path):
    build_shards(["x" * 10_000], ByteTokenizer(), tmp_path)
    shards = open_shards(tmp_path)
    payload = pickle.dumps(shards)
    assert len(payload) < 1_000
    np.testing.assert_array_equal(pickle.loads(payload)[:], shards[:])


def counting_builds(monkeypatch) -> list[Path]:
    """Wraps `build_shards` as `prepare_tokens` sees it; returns the list of build directories."""
    calls: list[Path] = []
    original = shards_module.build_shards

    def wrapped(documents, tokenizer, out_dir, **options):
        calls.append(Path(out_dir))
        return original(documents, tokenizer, out_dir, **options)

    monkeypatch.setattr(shards_module, "build_shards", wrapped)
    return calls


def test_prepare_reuses_the_cache_until_the_source_changes(tmp_path, monkeypatch):
    builds = counting_builds(monkeypatch)
    corpus = write_text_corpus(tmp_path / "corpus")
    config = CorpusConfig(source=str(corpus), split="all")
    tokenizer = ByteTokenizer()
    first = prepare_tokens(config, tokenizer, tmp_path / "cache")
    manifest_time = (first.directory / MANIFEST_NAME).stat().st_mtime_ns
    second = prepare_tokens(config, tokenizer, tmp_path / "cache")
    assert len(builds) == 1
    assert second.directory == first.directory
    assert (second.directory / MANIFEST_NAME).stat().st_mtime_ns == manifest_time
    documents = ["alpha document\n", "beta: Grüße\n"]
    assert second[:].tolist() == token_stream(tokenizer, documents)

    (corpus / "b.txt").write_text("beta, edited\n", encoding="utf-8")
    third = prepare_tokens(config, tokenizer, tmp_path / "cache")
    assert len(builds) == 2
    assert third.directory != first.directory
    assert third[:].tolist() == token_stream(tokenizer, ["alpha document\n", "beta, edited\n"])
    # No temporary build directory is left behind.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [first.directory.name, third.directory.name]
    )


def test_prepare_rebuilds_for_another_split_or_tokenizer(tmp_path, monkeypatch):
    builds = counting_builds(monkeypatch)
    corpus = write_text_corpus(tmp_path / "corpus")
    prepare_tokens(CorpusConfig(source=str(corpus), split="all"), ByteTokenizer(), tmp_path)
    prepare_tokens(CorpusConfig(source=str(corpus), split="all"), WideTokenizer(), tmp_path)
    assert len(builds) == 2


def test_interrupted_prepare_leaves_no_cache_entry(tmp_path, monkeypatch):
    corpus = write_text_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"

    def failing(config) -> Iterator[str]:
        yield "one document"
        raise KeyboardInterrupt

    monkeypatch.setattr(shards_module, "iter_documents", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(str(corpus), ByteTokenizer(), cache)
    assert list(cache.iterdir()) == []
    monkeypatch.undo()
    shards = prepare_tokens(CorpusConfig(source=str(corpus), split="all"), ByteTokenizer(), cache)
    assert shards.manifest.num_documents == 2


def test_stdlib_corpus_is_nonempty_and_deterministic():
    config = CorpusConfig(max_bytes=SMALL_STDLIB)
    first = list(iter_documents(config))
    assert first and all(isinstance(d, str) and d for d in first)
    assert list(iter_documents(config)) == first
    total = sum(len(d.encode("utf-8")) for d in first)
    # The cap stops after the document that reaches it.
    assert SMALL_STDLIB <= total < SMALL_STDLIB + 200_000
    assert total - len(first[-1].encode("utf-8")) < SMALL_STDLIB


def test_stdlib_split_is_disjoint_stable_and_excludes_tests():
    train = stdlib_files(CorpusConfig(split="train"))
    held_out = stdlib_files(CorpusConfig(split="held_out"))
    everything = stdlib_files(CorpusConfig(split="all"))
    assert train == stdlib_files(CorpusConfig(split="train"))
    assert not set(train) & set(held_out)
    assert set(train) | set(held_out) == set(everything)
    assert 0.01 < len(held_out) / len(everything) < 0.15
    # Membership is a function of the path alone: a larger fraction only adds files.
    assert set(held_out) <= set(stdlib_files(CorpusConfig(split="held_out", held_out_fraction=0.2)))
    assert all(in_split(p, "held_out", 0.05) for p in held_out)
    for path in everything:
        assert path.endswith(".py")
        assert not set(path.split("/")[:-1]) & STDLIB_EXCLUDED_DIRS
    assert "pydoc_data/topics.py" not in everything  # over 200 KB


def test_directory_reads_txt_and_jsonl_in_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("from a.txt", encoding="utf-8")
    lines = [json.dumps({"text": "line one", "id": 1}), "", json.dumps({"text": "line two"})]
    (tmp_path / "b" / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "b" / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "notes.md").write_text("not a document file", encoding="utf-8")
    documents = list(iter_documents(CorpusConfig(source=str(tmp_path), split="all")))
    assert documents == ["from a.txt", "line one", "line two"]


def test_user_documents_split_by_text_disjointly(tmp_path):
    texts = [f"document number {i}" for i in range(200)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    split = {
        name: list(iter_documents(CorpusConfig(source=str(source), split=name)))
        for name in ("train", "held_out")
    }
    assert split["held_out"] and not set(split["train"]) & set(split["held_out"])
    assert sorted(split["train"] + split["held_out"]) == sorted(texts)


def test_jsonl_without_the_text_field_names_file_and_line(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 .*string field 'text'"):
        list(iter_documents(CorpusConfig(source=str(source), split="all")))


def test_a_single_text_file_is_split_by_position_at_a_line_start(tmp_path):
    lines = [f"line {i:03d}: déjà vu\n" for i in range(200)]
    source = tmp_path / "book.txt"
    source.write_text("".join(lines), encoding="utf-8")
    split = {
        name: list(iter_documents(CorpusConfig(source=str(source), split=name)))
        for name in ("train", "held_out", "all")
    }
    # One document each, disjoint, together the whole file; the held-out part is about 5%.
    assert len(split["train"]) == len(split["held_out"]) == 1
    assert split["train"][0] + split["held_out"][0] == split["all"][0] == "".join(lines)
    assert split["held_out"][0].startswith("line ")
    assert len(split["held_out"][0].splitlines()) == 10


def test_a_single_text_file_is_read_only_up_to_max_bytes_at_a_character_boundary(tmp_path):
    source = tmp_path / "one-line.txt"
    source.write_text("é" * 10_000, encoding="utf-8")  # 20000 bytes, no newline
    config = CorpusConfig(source=str(source), split="train", max_bytes=1001)
    (document,) = iter_documents(config)
    assert document == "é" * 500


def test_invalid_utf8_names_the_file_and_line(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2 is not valid UTF-8 \(byte 0xe9\)"):
        list(iter_documents(CorpusConfig(source=str(jsonl), split="all")))
    text = tmp_path / "notes.txt"
    text.write_bytes(b"one\ntwo\nth\xffree\n")
    with pytest.raises(DataError, match=r"notes\.txt:3 is not valid UTF-8"):
        list(iter_documents(CorpusConfig(source=str(text), split="all")))


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_an_endless_source_is_refused_before_reading(tmp_path):
    with pytest.raises(DataError, match=r"'/dev/zero' is not a regular file or directory"):
        iter_documents(CorpusConfig(source="/dev/zero"))


def test_an_empty_tokenizer_directory_is_refused_naming_it(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "tok").mkdir()
    with pytest.raises(DataError, match=r"tokenizer directory .*tok' is empty"):
        load_tokenizer(str(tmp_path / "tok"))


def test_parquet_files_are_read_by_their_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"text": ["parquet one", "", "parquet two"], "n": [1, 2, 3]})
    pq.write_table(table, tmp_path / "part.parquet")
    documents = list(iter_documents(CorpusConfig(source=str(tmp_path), split="all")))
    assert documents == ["parquet one", "parquet two"]


def test_hf_dataset_on_disk_is_read_by_its_text_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["hf one", "hf two"]}).save_to_disk(tmp_path / "ds")
    config = CorpusConfig(source=str(tmp_path / "ds"), split="all")
    assert list(iter_documents(config)) == ["hf one", "hf two"]


def test_missing_optional_readers_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"part\.parquet needs pyarrow: pip install pyarrow"):
        list(read_parquet(tmp_path / "part.parquet"))
    with pytest.raises(ImportError, match="pip install datasets"):
        list(read_hf_dataset(tmp_path))


def test_missing_path_empty_directory_and_no_documents_raise_naming_the_path(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="missing"):
        iter_documents(CorpusConfig(source=str(missing)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError, match=rf"directory {re.escape(str(empty))} holds no document file"
    ):
        iter_documents(CorpusConfig(source=str(empty)))
    (empty / "blank.txt").write_text("", encoding="utf-8")
    with pytest.raises(
        ValueError, match=rf"no documents in split 'all' of {re.escape(str(empty))}"
    ):
        list(iter_documents(CorpusConfig(source=str(empty), split="all")))


def test_corpus_config_refuses_bad_fields():
    with pytest.raises(ValueError, match=r"split must be one of .* got 'test'"):
        CorpusConfig(split="test")
    with pytest.raises(ValueError, match=r"held_out_fraction must be in \[0, 1\), got 1.5"):
        CorpusConfig(held_out_fraction=1.5)
    with pytest.raises(ValueError, match="max_bytes must be >= 1, got 0"):
        CorpusConfig(max_bytes=0)
    assert CorpusConfig().source == STDLIB_SOURCE


def test_windows_overlap_by_one_token_and_drop_the_tail():
    tokens = np.arange(8, dtype=np.uint16)
    sequences = PackedSequences(tokens, seq_len=3)
    assert len(sequences) == 2
    assert sequences[0].tolist() == [0, 1, 2, 3]
    assert sequences[1].tolist() == [3, 4, 5, 6]
    assert sequences[1].dtype == torch.int64
    with pytest.raises(IndexError, match="out of range for 2 windows"):
        sequences[2]


def test_too_small_corpus_says_how_many_tokens_are_needed():
    with pytest.raises(ValueError, match="the corpus has 5 tokens; seq_len=8 needs at least 9"):
        PackedSequences(np.arange(5), seq_len=8)


def draw(sampler: ResumableSampler, count: int) -> list[int]:
    return [sampler.next_index() for _ in range(count)]


def test_sampler_order_is_fixed_by_the_seed():
    first = draw(ResumableSampler(50, seed=3), 120)
    assert draw(ResumableSampler(50, seed=3), 120) == first
    assert draw(ResumableSampler(50, seed=4), 120) != first
    # Each epoch is a permutation, and epochs are shuffled differently.
    assert sorted(first[:50]) == list(range(50)) == sorted(first[50:100])
    assert first[:50] != first[50:100]


def test_unshuffled_sampler_walks_windows_in_order():
    assert draw(ResumableSampler(4, seed=0, shuffle=False), 6) == [0, 1, 2, 3, 0, 1]


def test_resumed_sampler_continues_the_uninterrupted_sequence():
    uninterrupted = draw(ResumableSampler(23, seed=7), 80)
    for stop in (0, 5, 23, 40):
        sampler = ResumableSampler(23, seed=7)
        head = draw(sampler, stop)
        state = json.loads(json.dumps(sampler.state_dict()))
        resumed = ResumableSampler(23, seed=7)
        resumed.load_state_dict(state)
        assert head + draw(resumed, 80 - stop) == uninterrupted


def test_sampler_refuses_the_state_of_another_sequence():
    state = ResumableSampler(23, seed=7).state_dict()
    with pytest.raises(ValueError, match="seed = 7, this sampler has 8"):
        ResumableSampler(23, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="num_windows = 23, this sampler has 24"):
        ResumableSampler(24, seed=7).load_state_dict(state)


@pytest.mark.parametrize("num_windows", [12, 14])
def test_ranks_draw_disjoint_equal_shares_that_cover_the_epoch(num_windows):
    world = 3
    shares = [
        ResumableSampler(num_windows, seed=1, rank=r, world_size=world).epoch_indices(0)
        for r in range(world)
    ]
    assert {len(s) for s in shares} == {num_windows // world}
    together = np.concatenate(shares)
    assert len(set(together.tolist())) == together.size == num_windows // world * world
    if num_windows % world == 0:
        assert sorted(together.tolist()) == list(range(num_windows))


def test_sampler_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank must be < world_size = 2, got 2"):
        ResumableSampler(10, seed=0, rank=2, world_size=2)


def test_batches_stack_windows_and_resume_at_the_next_batch():
    tokens = np.arange(1_000, dtype=np.uint16)
    sequences = PackedSequences(tokens, seq_len=16)
    sampler = ResumableSampler(len(sequences), seed=0)
    stream = batches(sequences, sampler, batch_size=4)
    first = [next(stream) for _ in range(3)]
    assert first[0].shape == (4, 17) and first[0].dtype == torch.int64
    assert torch.equal(first[0][:, 1:] - first[0][:, :-1], torch.ones(4, 16, dtype=torch.int64))
    state = sampler.state_dict()
    expected = [next(stream) for _ in range(20)]
    resumed = ResumableSampler(len(sequences), seed=0)
    resumed.load_state_dict(state)
    stream = batches(sequences, resumed, batch_size=4)
    assert all(torch.equal(next(stream), batch) for batch in expected)


def test_stdlib_pipeline_from_documents_to_batches(tmp_path):
    tokenizer = ByteTokenizer()
    shards = prepare_tokens(CorpusConfig(max_bytes=SMALL_STDLIB), tokenizer, tmp_path)
    assert shards.manifest.num_tokens >= SMALL_STDLIB
    sequences = PackedSequences(shards, seq_len=128)
    batch = next(batches(sequences, ResumableSampler(len(sequences), seed=0), batch_size=2))
    assert batch.shape == (2, 129) and int(batch.max()) < tokenizer.vocab_size


def test_a_tokenizer_saved_on_disk_loads_through_transformers(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from deltalab.data import load_tokenizer

    model = tokenizers.models.BPE(unk_token="<unk>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"])
    raw.train_from_iterator(["def add(a, b):", "return a + b", "class Node: pass"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", eos_token="</s>"
    )
    fast.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    ids = tokenizer.encode("return a + b")
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids).replace(" ", "") == "returna+b"
    assert tokenizer.eos_id == fast.convert_tokens_to_ids("</s>")
