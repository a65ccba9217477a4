"""A prepared corpus on disk: token ids in flat binary shards, memory-mapped, with an index and a manifest.

Layout of a prepared directory (written by ``lightning-hpz prepare-data``)::

    shard-00000.bin ...   token ids, native byte order, dtype uint16 (vocabulary <= 65536) or uint32, no header
    index.json            the shards in order and the number of tokens in each
    manifest.json         tokenizer name, vocabulary size, end-of-sequence id, token count, largest id, source
                          fingerprint; written last, so a directory without it is an unfinished preparation

The shards concatenated are one token stream: every document followed by the end-of-sequence id, in source order.
Reading a range maps only the pages it touches, so a rank reading its slice of a 100 GB corpus holds a few pages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
INDEX = "index.json"
FORMAT_VERSION = 1
REPREPARE = "Re-run `lightning-hpz prepare-data --source SOURCE --tokenizer TOKENIZER --out {directory}`"


class PreparedDataError(ValueError):
    """A prepared directory that is unfinished, damaged, or does not fit the tokenizer or the model."""


@dataclass(frozen=True)
class Manifest:
    """What a prepared directory holds and what it was made from."""

    tokenizer: str
    vocab_size: int
    eos_id: int
    dtype: str
    tokens: int
    documents: int
    max_token_id: int
    source: str
    text_field: str
    errors: str
    fingerprint: list[list[Any]] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def shard_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_prepared(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def is_unfinished(directory: str | Path) -> bool:
    """Shards or leftovers of a preparation but no manifest: it was interrupted (or is still running)."""
    path = Path(directory)
    leftovers = [*path.glob("shard-*.bin*"), path / INDEX] if path.is_dir() else []
    return not is_prepared(path) and any(p.exists() for p in leftovers)


def read_manifest(directory: str | Path) -> Manifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise PreparedDataError(
            f"{directory} has no {MANIFEST}: it is not a prepared corpus, or its preparation did not finish. "
            + REPREPARE.format(directory=directory)
            + "."
        )
    fields = json.loads(path.read_text())
    if fields.get("format_version") != FORMAT_VERSION:
        raise PreparedDataError(
            f"{path} has format {fields.get('format_version')}, this version reads {FORMAT_VERSION}."
        )
    return Manifest(**fields)


def check_fits_tokenizer(shards: PreparedShards, tokenizer: Any) -> None:
    """Refuse shards made by another tokenizer, or holding ids the tokenizer's vocabulary does not have."""
    manifest, path = shards.manifest, shards.directory / MANIFEST
    if (manifest.tokenizer, manifest.vocab_size) != (tokenizer.name, tokenizer.vocab_size):
        raise PreparedDataError(
            f"{path} was prepared with tokenizer {manifest.tokenizer!r} (vocabulary {manifest.vocab_size}), but the "
            f"data module uses {tokenizer.name!r} (vocabulary {tokenizer.vocab_size}). Pass the tokenizer it was "
            "prepared with, or prepare the source again with --tokenizer set to this one."
        )
    if manifest.max_token_id >= tokenizer.vocab_size:
        raise PreparedDataError(
            f"{path}: the shards hold token id {manifest.max_token_id}, beyond the vocabulary of {tokenizer.vocab_size}"
            f" (ids would index past the embedding). {REPREPARE.format(directory=shards.directory)}."
        )


class PreparedShards:
    """The token stream of a prepared directory, checked on open and read by range through memory maps.

    Args:
        directory: the ``--out`` directory of ``prepare-data``.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.dtype = np.dtype(self.manifest.dtype)
        entries = json.loads((self.directory / INDEX).read_text())["shards"]
        self.files = [self.directory / entry["file"] for entry in entries]
        counts = [int(entry["tokens"]) for entry in entries]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._check_shards(counts)
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _check_shards(self, counts: list[int]) -> None:
        fix = REPREPARE.format(directory=self.directory)
        if sum(counts) != self.manifest.tokens:
            raise PreparedDataError(
                f"{self.directory / INDEX} lists {sum(counts)} tokens, {MANIFEST} {self.manifest.tokens}. {fix}."
            )
        for path, count in zip(self.files, counts, strict=True):
            if not path.is_file():
                raise PreparedDataError(f"Shard {path} is missing. {fix} (an unchanged source is re-read).")
            expected = count * self.dtype.itemsize
            if path.stat().st_size != expected:
                raise PreparedDataError(
                    f"Shard {path} has {path.stat().st_size} bytes, the index says {expected} ({count} tokens): it "
                    f"was truncated or overwritten. {fix}."
                )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start`` to ``stop`` of the stream (a copy, so the caller holds no map)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"token range [{start}, {stop}) outside the stream of {len(self)} tokens")
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[shard + 1]))
            first = int(self.starts[shard])
            pieces.append(self._map(shard)[start - first : end - first])
            start, shard = end, shard + 1
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)

    def _map(self, shard: int) -> np.memmap:
        if shard not in self._maps:  # opened on first use: a rank maps only the shards its examples live in
            self._maps[shard] = np.memmap(self.files[shard], dtype=self.dtype, mode="r")
        return self._maps[shard]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # dataloader workers map the files themselves
