"""Bad data is refused before training, naming the file and the fix: prepared shards, corpus files, corpus size."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from lightning_hpz.data import (
    CausalLMDataModule,
    CorpusError,
    PreparedDataError,
    SequenceTooLongError,
    prepare_corpus,
    read_corpus,
)
from lightning_hpz.data import corpus as corpus_module
from lightning_hpz.data.prepared_shards import MANIFEST


@pytest.fixture
def prepared(tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(200)))
    prepare_corpus(source, "byte", tmp_path / "prepared", shard_tokens=10_000, show_progress=False)
    return tmp_path / "prepared"


def _setup(source, world: int = 1, **options) -> CausalLMDataModule:
    datamodule = CausalLMDataModule(source=str(source), sequence_length=64, batch_size=4, **options)
    datamodule.trainer = SimpleNamespace(world_size=world, global_rank=0)
    datamodule.setup("fit")
    return datamodule


def test_prepared_directory_trains_as_it_is(prepared):
    datamodule = _setup(prepared)
    assert len(datamodule.shards.files) > 1 and len(datamodule.train_dataloader()) > 0


def test_truncated_shard(prepared):
    shard = prepared / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(
        PreparedDataError, match=r"shard-00001.bin has \d+ bytes, the index says .*Re-run `lightning-hpz"
    ):
        _setup(prepared)


def test_missing_shard(prepared):
    (prepared / "shard-00000.bin").unlink()
    with pytest.raises(PreparedDataError, match=r"shard-00000.bin is missing. Re-run `lightning-hpz prepare-data"):
        _setup(prepared)


def test_unfinished_preparation_has_no_manifest(prepared):
    (prepared / MANIFEST).unlink()
    with pytest.raises(
        PreparedDataError, match=r"prepared has no manifest.json: .*did not finish. Re-run `lightning-hpz"
    ):
        _setup(prepared)


def test_manifest_of_another_tokenizer(prepared, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(["paragraph 1 2 3"], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path / "tok")
    with pytest.raises(PreparedDataError, match=r"manifest.json was prepared with tokenizer 'byte' \(vocabulary 359\)"):
        _setup(prepared, tokenizer=str(tmp_path / "tok"))


def test_token_ids_beyond_the_vocabulary(prepared):
    shard = prepared / "shard-00000.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[5] = 9000  # a damaged shard, or one written by another tool
    tokens.tofile(shard)
    manifest = json.loads((prepared / MANIFEST).read_text())
    (prepared / MANIFEST).write_text(json.dumps({**manifest, "max_token_id": 9000}))
    with pytest.raises(PreparedDataError, match=r"token id 9000, beyond the vocabulary of 359"):
        _setup(prepared)


def test_empty_source(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n   \n")
    with pytest.raises(CorpusError, match=r"empty.txt' holds no text"):
        _setup(tmp_path / "empty.txt", cache_dir=str(tmp_path / "cache"))


def test_corpus_smaller_than_one_global_batch_names_the_numbers(tmp_path):
    (tmp_path / "small.txt").write_text("a short text " * 100)  # 1301 tokens: 20 sequences of 64, 19 for training
    message = r"1301 tokens: 19 training sequences of 64 tokens, fewer than one global batch of batch_size 4 x 8 ranks"
    with pytest.raises(SequenceTooLongError, match=message):
        _setup(tmp_path / "small.txt", world=8, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize(("value", "kind"), [("null", "NoneType"), ("[1, 2, 3]", "list"), ('{"a": 1}', "dict")])
def test_jsonl_text_that_is_not_a_string_names_file_and_line(tmp_path, value, kind):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": ' + value + "}\n")
    with pytest.raises(CorpusError, match=rf"bad.jsonl:3: 'text' is {kind} .*not a string"):
        read_corpus(path)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_non_utf8_bytes_name_file_and_byte_offset(tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(corpus_module, "READ_CHUNK_BYTES", 7)  # the bad byte lies chunks away from the start
    good = b'{"text": "caf\xc3\xa9 ok"}\n' if suffix == ".jsonl" else b"caf\xc3\xa9 ok\n\n"
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(good * 3 + good.replace(b"\xc3\xa9", b"\xe9"))  # Latin-1 e-acute, not UTF-8
    offset = len(good) * 3 + good.index(b"\xc3")
    with pytest.raises(
        CorpusError, match=rf"latin1{suffix}(:4)? is not UTF-8 at byte offset {offset} .*errors='replace'"
    ):
        read_corpus(path)
    assert read_corpus(path, errors="replace")[-1].startswith("caf\ufffd ok")
    assert read_corpus(path, errors="ignore")[-1].startswith("caf ok")


def test_unknown_errors_option():
    with pytest.raises(CorpusError, match=r"errors='loose': choose one of"):
        read_corpus("default", errors="loose")


def test_txt_read_in_small_chunks_splits_exactly_like_the_whole_file(tmp_path, monkeypatch):
    text = "a\n\n\nb\n\nc\n\n\n\nd\ne\n\n" * 5 + "tail ✓ é"
    (tmp_path / "t.txt").write_text(text)
    monkeypatch.setattr(corpus_module, "READ_CHUNK_BYTES", 3)
    assert read_corpus(tmp_path / "t.txt") == [doc for doc in text.split("\n\n") if doc.strip()]


def test_too_small_corpus_fails_trainer_fit_instead_of_training_nothing(tmp_path):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    (tmp_path / "small.txt").write_text("a short text " * 40)
    datamodule = CausalLMDataModule(str(tmp_path / "small.txt"), sequence_length=64, cache_dir=str(tmp_path / "c"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(SequenceTooLongError, match=r"fewer than one global batch of batch_size 8 x 1 ranks = 8"):
        trainer.fit(BoringModel(), datamodule)
    assert trainer.global_step == 0
