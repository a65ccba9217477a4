"""Tokenizers and packing into fixed-length sequences."""

import pytest
import torch

from lightning_hpz.data import ByteTokenizer, SequenceTooLongError, TokenizerNotFoundError, load_tokenizer, pack_tokens


def test_byte_tokenizer_round_trips_unicode():
    tokenizer = ByteTokenizer()
    text = "naïve café, ünïcode ✓"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert min(ids) >= 3 and max(ids) < 259
    assert tokenizer.sentinel_ids(3) == [259, 260, 261] and tokenizer.vocab_size == 359


def test_documents_are_separated_by_end_tokens():
    tokenizer = ByteTokenizer()
    stream = tokenizer.encode_documents(["ab", "c"]).tolist()
    assert stream == [*tokenizer.encode("ab"), tokenizer.eos_id, *tokenizer.encode("c"), tokenizer.eos_id]


def test_packing_keeps_the_stream_in_order_and_drops_only_the_tail():
    tokens = torch.arange(1000)
    blocks = pack_tokens(tokens, 64)
    assert blocks.shape == (15, 64)
    assert torch.equal(blocks.flatten(), tokens[: 15 * 64])


def test_corpus_shorter_than_one_sequence():
    with pytest.raises(SequenceTooLongError, match="fewer than one sequence of 64"):
        pack_tokens(torch.arange(10), 64)


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
    documents = ["the cat", "sat on the mat", "the"]
    one_by_one = [i for doc in documents for i in [*tokenizer.encode(doc), tokenizer.eos_id]]
    assert tokenizer.encode_documents(documents).tolist() == one_by_one  # one batched call, same ids
    assert tokenizer.eos_id == 1
    with pytest.raises(ValueError, match="no T5 sentinel tokens"):
        tokenizer.sentinel_ids(2)


def test_batched_encoding_ignores_padding_and_truncation_saved_with_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.train_from_iterator(["the river and the stone"] * 20, trainers.BpeTrainer(special_tokens=["<unk>", "</s>"]))
    raw.enable_truncation(max_length=2)  # a tokenizer.json written for inference; preparation must keep every id
    raw.enable_padding(length=16, pad_id=0)
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    documents = ["the river", "", "stone and the river and the stone, naïve ✓"]
    one_by_one = [i for doc in documents for i in [*tokenizer.encode(doc), tokenizer.eos_id]]
    assert len(one_by_one) > 16 and tokenizer.encode_documents(documents).tolist() == one_by_one


def test_tokenizer_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match="'byte' for the built-in byte tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))
