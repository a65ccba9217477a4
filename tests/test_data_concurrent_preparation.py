"""Two processes (two nodes, two jobs) preparing one source into one directory: tokenized once, never a hang."""

import json
import multiprocessing
import os
import signal
import time

import numpy as np

from lightning_hpz.data import ByteTokenizer, PreparedShards, preparation, prepare_corpus, read_corpus
from lightning_hpz.data.prepared_shards import is_prepared

# fork: the children inherit the imported modules and the test's patches; nothing here starts threads first
CONTEXT = multiprocessing.get_context("fork")
JOIN_SECONDS = 120  # far beyond a few-kilobyte preparation even on a loaded machine: only a hang reaches it


def _source(tmp_path):
    source = tmp_path / "small.txt"
    source.write_text("\n\n".join(f"paragraph {i} of the shared corpus" for i in range(300)))
    return source


def _expected(source) -> np.ndarray:
    tokenizer = ByteTokenizer()
    return np.array([i for doc in read_corpus(source) for i in [*tokenizer.encode(doc), tokenizer.eos_id]])


def _record_tokenization(log, hold_seconds: float = 0.0, holding=None):
    """Wrap ``encoded_batches`` so each tokenization leaves a line in ``log`` (and, optionally, lingers)."""
    real = preparation.encoded_batches

    def recorded(*args):
        with open(log, "a") as file:
            file.write(f"{os.getpid()}\n")
        batches = real(*args)
        yield next(batches)  # some shards are written (and one is half-written) by now
        if holding is not None:
            holding.set()
        time.sleep(hold_seconds)  # keeps the lock long enough for the other process to arrive and wait
        yield from batches

    preparation.encoded_batches = recorded


def _prepare_in_child(source, out, log, result_file, start=None, hold_seconds=0.0, holding=None):
    preparation.BATCH_CHARACTERS = 2000  # several batches, so the lock is held across a pause between two
    _record_tokenization(log, hold_seconds, holding)
    if start is not None:
        start.wait()
    manifest = prepare_corpus(source, "byte", out, shard_tokens=500, show_progress=False)
    result_file.write_text(manifest.to_json())


def test_two_processes_preparing_one_source_at_once_tokenize_it_once(tmp_path):
    source, out, log = _source(tmp_path), tmp_path / "cache", tmp_path / "tokenized.log"
    start = CONTEXT.Barrier(2)
    children = [
        CONTEXT.Process(target=_prepare_in_child, args=(source, out, log, tmp_path / f"r{n}.json", start, 1.0))
        for n in range(2)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(JOIN_SECONDS)
    assert [child.exitcode for child in children] == [0, 0]
    assert len(log.read_text().split()) == 1  # the second found the first's finished shards
    manifests = [json.loads((tmp_path / f"r{n}.json").read_text()) for n in range(2)]
    assert manifests[0] == manifests[1]
    shards = PreparedShards(out)
    assert len(shards.files) > 1 and np.array_equal(shards.read(0, len(shards)), _expected(source))


def test_a_preparer_killed_while_holding_the_lock_does_not_block_the_next(tmp_path):
    source, out, log = _source(tmp_path), tmp_path / "cache", tmp_path / "tokenized.log"
    holding = CONTEXT.Event()
    holder = CONTEXT.Process(
        target=_prepare_in_child, args=(source, out, log, tmp_path / "h.json", None, 3600.0, holding)
    )
    holder.start()
    assert holding.wait(JOIN_SECONDS)  # the holder is inside the lock, tokenizing
    waiter = CONTEXT.Process(target=_prepare_in_child, args=(source, out, log, tmp_path / "w.json"))
    waiter.start()
    time.sleep(0.5)  # let the waiter reach the lock (if it has not yet, it finds the lock free: same outcome)
    os.kill(holder.pid, signal.SIGKILL)  # no cleanup runs: only the kernel releases the lock
    holder.join(JOIN_SECONDS)
    waiter.join(JOIN_SECONDS)
    assert holder.exitcode == -signal.SIGKILL and waiter.exitcode == 0
    assert len(log.read_text().split()) == 2 and is_prepared(out)
    shards = PreparedShards(out)
    assert np.array_equal(shards.read(0, len(shards)), _expected(source))
