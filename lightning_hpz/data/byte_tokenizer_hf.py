"""The built-in byte tokenizer as a Hugging Face tokenizer, so an exported model loads with ``AutoTokenizer``.

Same ids as :class:`~lightning_hpz.data.tokenizers.ByteTokenizer`: 0 pad, 1 end of sequence, 2 unknown, byte ``b`` at
``b + 3``, then the T5 sentinels. Bytes are spelled as the printable characters of the ``tokenizers`` byte-level
alphabet; with no merges, every byte stays one token.
"""

from __future__ import annotations

from typing import Any

from lightning_hpz.data.tokenizers import ByteTokenizer

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}


def byte_alphabet() -> dict[int, str]:
    """Byte -> the character the byte-level pre-tokenizer writes for it (printable bytes stand for themselves)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


def byte_tokenizer_as_huggingface(byte_tokenizer: ByteTokenizer) -> Any:
    """A ``PreTrainedTokenizerFast`` that encodes and decodes exactly as ``byte_tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    sentinels = [f"<extra_id_{i}>" for i in range(byte_tokenizer.num_sentinels)]
    vocab = {SPECIAL_TOKENS["pad_token"]: byte_tokenizer.pad_id, SPECIAL_TOKENS["eos_token"]: byte_tokenizer.eos_id}
    vocab[SPECIAL_TOKENS["unk_token"]] = byte_tokenizer.unk_id
    vocab.update({char: b + byte_tokenizer.byte_offset for b, char in byte_alphabet().items()})
    vocab.update(zip(sentinels, byte_tokenizer.sentinel_ids(len(sentinels)), strict=True))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, additional_special_tokens=sentinels, **SPECIAL_TOKENS)
