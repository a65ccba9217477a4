"""Tokenizers, the token cache and packing into fixed-length sequences."""

import pytest
import torch

from lightning_hpz.data import (
    ByteTokenizer,
    SequenceTooLongError,
    TokenizerNotFoundError,
    load_tokenizer,
    pack_tokens,
    token_cache,
)
from lightning_hpz.data.token_cache import cached_token_stream, tokenize_documents


def test_byte_tokenizer_round_trips_unicode():
    tokenizer = ByteTokenizer()
    text = "naïve café, ünïcode ✓"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert min(ids) >= 3 and max(ids) < 259
    assert tokenizer.sentinel_ids(3) == [259, 260, 261] and tokenizer.vocab_size == 359


def test_documents_are_separated_by_end_tokens():
    tokenizer = ByteTokenizer()
    stream = tokenize_documents(["ab", "c"], tokenizer).tolist()
    assert stream == [*tokenizer.encode("ab"), tokenizer.eos_id, *tokenizer.encode("c"), tokenizer.eos_id]


def test_packing_keeps_the_stream_in_order_and_drops_only_the_tail():
    tokens = torch.arange(1000)
    blocks = pack_tokens(tokens, 64)
    assert blocks.shape == (15, 64)
    assert torch.equal(blocks.flatten(), tokens[: 15 * 64])


def test_corpus_shorter_than_one_sequence():
    with pytest.raises(SequenceTooLongError, match="fewer than one sequence of 64"):
        pack_tokens(torch.arange(10), 64)


def test_tokenizes_once_then_reads_the_cache(tmp_path, monkeypatch):
    documents, tokenizer = ["some text", "more text"], ByteTokenizer()
    first = cached_token_stream(documents, tokenizer, tmp_path)
    monkeypatch.setattr(token_cache, "tokenize_documents", lambda *a: pytest.fail("tokenized twice"))
    assert torch.equal(cached_token_stream(documents, tokenizer, tmp_path), first)
    assert len(list(tmp_path.glob("tokens-*.pt"))) == 1


def test_cache_key_changes_with_content_and_tokenizer():
    base = token_cache.corpus_key(["a b"], ByteTokenizer())
    assert token_cache.corpus_key(["a c"], ByteTokenizer()) != base
    other = ByteTokenizer()
    other.name = "other"
    assert token_cache.corpus_key(["a b"], other) != base


def test_hugging_face_tokenizer_from_a_local_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(["the cat sat on the mat"], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.vocab_size == 7
    assert len(tokenizer.encode("the cat sat")) == 3
    assert tokenizer.eos_id == 1
    with pytest.raises(ValueError, match="no T5 sentinel tokens"):
        tokenizer.sentinel_ids(2)


def test_tokenizer_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match="'byte' for the built-in byte tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))
