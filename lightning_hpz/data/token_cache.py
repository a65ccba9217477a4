"""Tokenize a corpus once: the token stream is cached on disk under a key of (corpus content, tokenizer)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from lightning_hpz.data.tokenizers import Tokenizer


def corpus_key(documents: list[str], tokenizer: Tokenizer) -> str:
    """A name that changes whenever the text or the tokenizer changes."""
    digest = hashlib.sha256(tokenizer.name.encode())
    for doc in documents:
        digest.update(hashlib.sha256(doc.encode("utf-8", errors="replace")).digest())
    return digest.hexdigest()[:20]


def tokenize_documents(documents: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """One stream of token ids: each document followed by the end-of-sequence token."""
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def cached_token_stream(documents: list[str], tokenizer: Tokenizer, cache_dir: str | Path) -> torch.Tensor:
    """The token stream of ``documents``, read from ``cache_dir`` when it was computed before."""
    path = Path(cache_dir) / f"tokens-{corpus_key(documents, tokenizer)}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    tokens = tokenize_documents(documents, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(tokens, partial)
    partial.replace(path)  # atomic: a rank reading concurrently never sees half a file
    return tokens
