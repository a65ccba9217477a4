"""prepare-data: the shards hold exactly the stream the in-memory path made, in parallel or not, once, atomically."""

import contextlib
import json
import os
import random

import numpy as np
import pytest

from lightning_hpz.cli import main as cli_main
from lightning_hpz.data import ByteTokenizer, PreparedShards, preparation, prepare_corpus, read_corpus
from lightning_hpz.data.preparation_lock import LOCK_FILE
from lightning_hpz.data.prepared_shards import MANIFEST, is_prepared

WORDS = ["river", "stone", "light", "naïve", "café", "über", "fox", "✓", "the", "of"]


def _paragraphs(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def _in_memory_stream(source, tokenizer) -> np.ndarray:
    """The old path: read every document into a list, encode one at a time, end token after each."""
    return np.array([i for doc in read_corpus(source) for i in [*tokenizer.encode(doc), tokenizer.eos_id]])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    (directory / "a.txt").write_text("\n\n\n".join(_paragraphs(400)) + "\n")
    (directory / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in _paragraphs(300, seed=1)))
    return directory


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl"])
def test_shards_hold_the_in_memory_stream_across_shard_and_batch_boundaries(corpus, tmp_path, monkeypatch, name):
    monkeypatch.setattr(preparation, "BATCH_CHARACTERS", 500)  # many batches
    manifest = prepare_corpus(corpus / name, "byte", tmp_path, shard_tokens=3000, show_progress=False)
    shards = PreparedShards(tmp_path)
    expected = _in_memory_stream(corpus / name, ByteTokenizer())
    assert len(shards.files) > 2 and manifest.tokens == expected.size
    assert np.array_equal(shards.read(0, len(shards)), expected)
    assert np.array_equal(shards.read(2990, 3010), expected[2990:3010])  # a range across two shards
    assert manifest.eos_id == 1 and manifest.vocab_size == 359 and manifest.max_token_id == expected.max()


def test_the_default_corpus_prepares_to_the_in_memory_stream(tmp_path):
    prepare_corpus("default", "byte", tmp_path, show_progress=False)
    shards = PreparedShards(tmp_path)
    assert np.array_equal(shards.read(0, len(shards)), _in_memory_stream("default", ByteTokenizer()))


def test_two_workers_write_the_same_shards_as_one(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(preparation, "BATCH_CHARACTERS", 300)
    prepare_corpus(corpus / "a.txt", "byte", tmp_path / "one", num_workers=1, show_progress=False)
    prepare_corpus(corpus / "a.txt", "byte", tmp_path / "two", num_workers=2, show_progress=False)
    one, two = PreparedShards(tmp_path / "one"), PreparedShards(tmp_path / "two")
    assert np.array_equal(one.read(0, len(one)), two.read(0, len(two)))


def test_rerun_on_an_unchanged_source_does_nothing_and_a_changed_one_reprepares(corpus, tmp_path, monkeypatch):
    source = tmp_path / "c.txt"
    source.write_text("one paragraph\n\nanother\n")
    prepare_corpus(source, "byte", tmp_path / "out", show_progress=False)
    with monkeypatch.context() as patch:
        patch.setattr(preparation, "encoded_batches", lambda *a: pytest.fail("tokenized an unchanged source again"))
        prepare_corpus(source, "byte", tmp_path / "out", show_progress=False)
    source.write_text("one paragraph\n\nanother, longer\n")
    expected = _in_memory_stream(source, ByteTokenizer())
    assert prepare_corpus(source, "byte", tmp_path / "out", show_progress=False).tokens == expected.size


def test_an_interrupted_preparation_leaves_nothing_that_reads_as_prepared(corpus, tmp_path, monkeypatch):
    prepare_corpus(corpus / "a.txt", "byte", tmp_path, show_progress=False)  # an older, complete preparation
    (tmp_path / "notes.tmp").write_text("the user's own file")
    real = preparation.encoded_batches

    def killed_midway(*args):
        batches = real(*args)
        yield next(batches)
        raise KeyboardInterrupt  # what Ctrl-C (or a kill between two batches) does

    monkeypatch.setattr(preparation, "BATCH_CHARACTERS", 200)
    monkeypatch.setattr(preparation, "encoded_batches", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(corpus / "a.jsonl", "byte", tmp_path, shard_tokens=100, show_progress=False)
    assert not is_prepared(tmp_path) and sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, "notes.tmp"]


def test_command_line_tool(corpus, tmp_path, capsys):
    out = tmp_path / "prepared"
    cli_main(["prepare-data", "--source", str(corpus / "a.txt"), "--tokenizer", "byte", "--out", str(out), "--quiet"])
    assert "tokens from 400 documents" in capsys.readouterr().out
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["fingerprint"][0][:2] == ["a.txt", (corpus / "a.txt").stat().st_size]
    cli_main(["prepare-data", "--source", str(corpus / "a.txt"), "--tokenizer", "byte", "--out", str(out), "--quiet"])
    assert "unchanged" in capsys.readouterr().out


def test_command_line_refuses_an_empty_source_naming_it(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(SystemExit, match=r"prepare-data: The corpus .*empty.jsonl' holds no text"):
        cli_main(
            [
                "prepare-data",
                "--source",
                str(tmp_path / "empty.jsonl"),
                "--tokenizer",
                "byte",
                "--out",
                str(tmp_path / "x"),
            ]
        )
    assert not (tmp_path / "x").exists()  # nothing created for a source with nothing to prepare


def test_workers_fork_single_threaded_and_the_caller_keeps_its_tokenizers_setting(corpus, tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    seen = []
    real = preparation._single_threaded_tokenizers

    def recording():
        with real():
            seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))  # what the forked workers inherit
            yield

    monkeypatch.setattr(preparation, "_single_threaded_tokenizers", contextlib.contextmanager(recording))
    prepare_corpus(corpus / "a.txt", "byte", tmp_path / "a", num_workers=2, show_progress=False)
    assert seen == ["false"] and "TOKENIZERS_PARALLELISM" not in os.environ
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the user's choice wins, in the workers too
    prepare_corpus(corpus / "a.txt", "byte", tmp_path / "b", num_workers=2, show_progress=False)
    assert seen == ["false", "true"] and os.environ["TOKENIZERS_PARALLELISM"] == "true"
