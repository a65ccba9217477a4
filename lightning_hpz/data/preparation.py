"""Tokenize a corpus once, in parallel and streaming, into a prepared directory (see :mod:`prepared_shards`).

Documents are read lazily and grouped into batches of about a megabyte of text; each batch is encoded by one batched
tokenizer call in one of ``num_workers`` processes; the results are written in source order. At most two batches per
worker are in flight, so memory stays flat however large the corpus is.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_hpz.data.corpus import CorpusError, is_default, iter_documents, stdlib_source_files
from lightning_hpz.data.preparation_lock import exclusive_preparation
from lightning_hpz.data.prepared_shards import (
    Manifest,
    PreparedDataError,
    PreparedShards,
    is_prepared,
    read_manifest,
    shard_dtype,
)
from lightning_hpz.data.shard_writer import DEFAULT_SHARD_TOKENS, ShardWriter, clear_preparation
from lightning_hpz.data.tokenizers import Tokenizer, load_tokenizer

BATCH_CHARACTERS = 1 << 20
IN_FLIGHT_PER_WORKER = 2


@dataclass(frozen=True)
class EncodedBatch:
    tokens: np.ndarray  # already in the shard dtype
    documents: int
    max_token_id: int


def source_fingerprint(source: str | Path) -> list[list[Any]]:
    """``[name, size, mtime_ns]`` of every file the source is read from: cheap to compute, no text is hashed."""
    if is_default(source):
        from pydoc_data import topics

        files = [Path(topics.__file__)] + (stdlib_source_files() if str(source) != "default" else [])
        return [[path.name, *_size_and_mtime(path)] for path in files]
    path = Path(source)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p.relative_to(path)) if path.is_dir() else p.name, *_size_and_mtime(p)] for p in files]


def _size_and_mtime(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def prepare_corpus(
    source: str | Path,
    tokenizer: str,
    out: str | Path,
    num_workers: int = 1,
    text_field: str = "text",
    errors: str = "strict",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    show_progress: bool = True,
) -> Manifest:
    """Prepare ``source`` into ``out`` unless ``out`` already holds it (same files, tokenizer and options).

    Raises :class:`~lightning_hpz.data.corpus.CorpusError` for an unreadable or empty source.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be at least 1.")
    loaded = load_tokenizer(tokenizer)
    out = Path(out)
    fingerprint = source_fingerprint(source) if is_default(source) or Path(source).exists() else []
    if _already_prepared(out, loaded.name, text_field, errors, fingerprint):  # no lock: a read-only DIR works
        return read_manifest(out)
    # A missing or empty source, or a bad option, is refused before anything is created or removed.
    if next(iter_documents(source, text_field, errors), None) is None:
        raise _no_text(source)
    with exclusive_preparation(out, announce_wait=show_progress):
        if _already_prepared(out, loaded.name, text_field, errors, fingerprint):  # done by the process we waited for
            return read_manifest(out)
        return _prepare(
            source, tokenizer, loaded, out, fingerprint, num_workers, text_field, errors, shard_tokens, show_progress
        )


def _prepare(
    source: str | Path,
    spec: str,
    loaded: Tokenizer,
    out: Path,
    fingerprint: list,
    num_workers: int,
    text_field: str,
    errors: str,
    shard_tokens: int,
    show_progress: bool,
) -> Manifest:
    """Tokenize ``source`` into ``out`` from scratch; the caller holds the directory's preparation lock."""
    clear_preparation(out)
    writer = ShardWriter(out, shard_dtype(loaded.vocab_size), shard_tokens)
    total_bytes = 0 if is_default(source) else sum(size for _, size, _ in fingerprint)  # 0: no total, no ETA
    with _progress_bar(total_bytes, show_progress, out) as bar:
        stream = iter_documents(source, text_field, errors, progress=bar.update)
        try:
            tokens, documents, max_id = _write_shards(stream, spec, loaded, writer, num_workers)
        except BaseException:
            writer.abandon()
            clear_preparation(out)  # nothing half-done stays behind: the next run starts from a clean directory
            raise
    if documents == 0:  # emptied since the check above
        clear_preparation(out)
        raise _no_text(source)
    manifest = Manifest(
        loaded.name, loaded.vocab_size, loaded.eos_id, writer.dtype.name, tokens, documents, max_id, str(source),
        text_field, errors, fingerprint,
    )  # fmt: skip
    writer.finish(manifest)
    return manifest


def _no_text(source: str | Path) -> CorpusError:
    return CorpusError(f"The corpus {str(source)!r} holds no text. Point --source at a file with text in it.")


def _write_shards(
    stream: Iterator[str], spec: str, tokenizer: Tokenizer, writer: ShardWriter, num_workers: int
) -> tuple[int, int, int]:
    """Encode the documents into ``writer``: (tokens, documents, largest token id)."""
    tokens, documents, max_id = 0, 0, -1
    for batch in encoded_batches(stream, spec, tokenizer, writer.dtype, num_workers):
        writer.append(batch.tokens)
        tokens, documents = tokens + batch.tokens.size, documents + batch.documents
        max_id = max(max_id, batch.max_token_id)
    return tokens, documents, max_id


def _already_prepared(out: Path, tokenizer: str, text_field: str, errors: str, fingerprint: list) -> bool:
    if not fingerprint or not is_prepared(out):
        return False
    try:
        manifest = read_manifest(out)
        PreparedShards(out)  # every shard present and complete
    except (PreparedDataError, ValueError, TypeError, OSError):
        return False
    wanted = (tokenizer, text_field, errors, fingerprint)
    return (manifest.tokenizer, manifest.text_field, manifest.errors, manifest.fingerprint) == wanted


def _progress_bar(total_bytes: int, show: bool, out: Path) -> Any:
    from tqdm.auto import tqdm

    description = f"prepare-data -> {out}"
    return tqdm(
        total=total_bytes or None, unit="B", unit_scale=True, unit_divisor=1024, desc=description, disable=not show
    )


def document_batches(documents: Iterator[str], characters: int = BATCH_CHARACTERS) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= characters:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encoded_batches(
    documents: Iterator[str], spec: str, tokenizer: Tokenizer, dtype: np.dtype, num_workers: int
) -> Iterator[EncodedBatch]:
    """Batches encoded in source order, by this process (one worker) or by a pool of ``num_workers`` processes."""
    batches = document_batches(documents)
    if num_workers == 1:
        yield from (encode_batch(tokenizer, batch, dtype) for batch in batches)
        return
    # fork: the workers inherit the imported modules (no re-import of torch per worker).
    with _single_threaded_tokenizers():
        pool = multiprocessing.get_context("fork").Pool(num_workers, _start_worker, (spec, dtype))
    with pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


@contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """Fork workers with ``TOKENIZERS_PARALLELISM=false`` unless the user set it; this process keeps its setting.

    One core per worker: a Hugging Face tokenizer's own thread pool in each worker would compete with the others (in
    this process, with one worker, it spreads one batch over the cores). Set before the fork, it also keeps
    ``tokenizers`` from warning that a pool it had used here was disabled in the children.
    """
    chosen = "TOKENIZERS_PARALLELISM" in os.environ
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        yield
    finally:
        if not chosen:
            del os.environ["TOKENIZERS_PARALLELISM"]


def encode_batch(tokenizer: Tokenizer, documents: list[str], dtype: np.dtype) -> EncodedBatch:
    ids = tokenizer.encode_documents(documents)
    max_id = int(ids.max()) if ids.size else -1
    if max_id > np.iinfo(dtype).max:
        raise PreparedDataError(
            f"Token id {max_id} does not fit the shard dtype {dtype}: the tokenizer's vocab_size "
            f"{tokenizer.vocab_size} is smaller than its ids. Use a consistent tokenizer."
        )
    return EncodedBatch(ids.astype(dtype), len(documents), max_id)


_worker: dict[str, Any] = {}


def _start_worker(spec: str, dtype: np.dtype) -> None:
    _worker["tokenizer"], _worker["dtype"] = load_tokenizer(spec), dtype


def _encode_in_worker(documents: list[str]) -> EncodedBatch:
    return encode_batch(_worker["tokenizer"], documents, _worker["dtype"])
