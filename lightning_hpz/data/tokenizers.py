"""Tokenizers: a byte-level one that needs no files (the default), or a Hugging Face tokenizer from a local path."""

from __future__ import annotations

import copy
import hashlib
import itertools
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Tokenizer(Protocol):
    """What the data pipelines need from a tokenizer."""

    name: str
    vocab_size: int
    pad_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_documents(self, documents: list[str]) -> np.ndarray: ...

    def sentinel_ids(self, count: int) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: id 0 = pad, 1 = end of sequence, 2 = unknown, 3..258 = bytes, then T5 sentinels.

    Needs no vocabulary file, so the default corpus trains with no download; the tiny presets' vocabulary (384) holds
    it with its 100 sentinels.
    """

    name = "byte"
    pad_id = 0
    eos_id = 1
    unk_id = 2
    byte_offset = 3

    def __init__(self, num_sentinels: int = 100) -> None:
        self.num_sentinels = num_sentinels
        self.vocab_size = self.byte_offset + 256 + num_sentinels

    def encode(self, text: str) -> list[int]:
        return [b + self.byte_offset for b in text.encode("utf-8")]

    def encode_documents(self, documents: list[str]) -> np.ndarray:
        """One stream of ids: each document's bytes followed by the end-of-sequence id (vectorized, no Python loop)."""
        encoded = [doc.encode("utf-8") for doc in documents]
        ids = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int64) + self.byte_offset
        return end_each_document(ids, np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), self.eos_id)

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.byte_offset for i in ids if self.byte_offset <= i < self.byte_offset + 256)
        return data.decode("utf-8", errors="replace")

    def sentinel_ids(self, count: int) -> list[int]:
        if count > self.num_sentinels:
            raise ValueError(f"{count} sentinels requested, the byte tokenizer has {self.num_sentinels}.")
        first = self.byte_offset + 256
        return list(range(first, first + count))


class TokenizerNotFoundError(FileNotFoundError):
    """``tokenizer=`` names neither ``"byte"`` nor a local tokenizer directory."""


class HuggingFaceTokenizer:
    """A transformers tokenizer loaded from a local directory (no hub access), e.g. the one shipped with a model."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise TokenizerNotFoundError(
                f"tokenizer={str(path)!r} is not a directory. Pass 'byte' for the built-in byte tokenizer, or the "
                "local directory of a Hugging Face tokenizer (tokenizer.json / tokenizer_config.json)."
            )
        self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        digest = hashlib.sha256(str(sorted(self._tokenizer.get_vocab().items())).encode()).hexdigest()[:12]
        self.name = f"hf-{path.name}-{digest}"
        self.vocab_size = len(self._tokenizer)
        self.eos_id = self._tokenizer.eos_token_id if self._tokenizer.eos_token_id is not None else 0
        self.pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else self.eos_id
        self._backend = _batch_backend(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def encode_documents(self, documents: list[str]) -> np.ndarray:
        """One stream of ids: each document followed by the end-of-sequence id, from one batched (Rust) call."""
        if self._backend is None:  # a slow (pure Python) tokenizer: no batch call to make
            ids = [self.encode(doc) for doc in documents]
        else:  # encode_batch_fast (tokenizers >= 0.21) skips the character offsets, which nobody here reads
            encode_batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            ids = [encoding.ids for encoding in encode_batch(documents, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        return end_each_document(flat, lengths, self.eos_id)

    def sentinel_ids(self, count: int) -> list[int]:
        ids = [self._tokenizer.convert_tokens_to_ids(f"<extra_id_{i}>") for i in range(count)]
        if any(i is None or i == self._tokenizer.unk_token_id for i in ids):
            raise ValueError(
                f"The tokenizer at {self.name} has no T5 sentinel tokens <extra_id_0>..<extra_id_{count - 1}>: span "
                "corruption needs a T5/mT5 tokenizer."
            )
        return ids


def end_each_document(ids: np.ndarray, lengths: np.ndarray, eos_id: int) -> np.ndarray:
    """``ids`` (the documents' ids back to back, ``lengths`` each) with ``eos_id`` after each document."""
    return np.insert(ids, np.cumsum(lengths), eos_id)


def _batch_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a fast tokenizer, with no padding or truncation; None for a slow tokenizer.

    Called directly it skips what ``tokenizer(list)`` builds per document in Python (attention masks, a
    ``BatchEncoding``).
    """
    if not getattr(tokenizer, "is_fast", False):
        return None
    backend = copy.deepcopy(tokenizer.backend_tokenizer)  # transformers sets padding/truncation on its own per call
    backend.no_padding()
    backend.no_truncation()
    return backend


def load_tokenizer(spec: str = "byte") -> Tokenizer:
    """``"byte"`` for :class:`ByteTokenizer`, otherwise the local directory of a Hugging Face tokenizer."""
    return ByteTokenizer() if spec == "byte" else HuggingFaceTokenizer(spec)
