"""``lightning-hpz prepare-data``: tokenize a corpus once into memory-mapped shards that training reads directly.

Imports nothing heavy at module level, so ``lightning-hpz --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-hpz prepare-data",
        description="Tokenize .txt / .jsonl / .parquet / a datasets directory into token shards + index + manifest. "
        "Train on them with `data.init_args.source: OUT` (same tokenizer). Re-running on an unchanged source does "
        "nothing; an interrupted run leaves nothing that reads as prepared.",
    )
    parser.add_argument("--source", required=True, help="file or directory to read ('default' for the embedded text)")
    parser.add_argument("--tokenizer", required=True, help="'byte' or the local directory of a Hugging Face tokenizer")
    parser.add_argument("--out", required=True, help="directory to write the shards into")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument("--text-field", default="text", help="field (.jsonl) or column (.parquet) holding the text")
    parser.add_argument(
        "--errors", default="strict", choices=("strict", "replace", "ignore"), help="what to do with non-UTF-8 bytes"
    )
    parser.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard file (default 2^28)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def prepare_data_main(argv: Sequence[str] = ()) -> None:
    args = build_parser().parse_args(list(argv))
    from lightning_hpz.data.corpus import CorpusError
    from lightning_hpz.data.preparation import prepare_corpus
    from lightning_hpz.data.preparation_lock import PreparationLockError
    from lightning_hpz.data.prepared_shards import PreparedDataError
    from lightning_hpz.data.shard_writer import DEFAULT_SHARD_TOKENS
    from lightning_hpz.data.tokenizers import TokenizerNotFoundError

    manifest_file = Path(args.out) / "manifest.json"
    before = manifest_file.stat().st_mtime_ns if manifest_file.is_file() else None
    started = time.perf_counter()
    try:
        manifest = prepare_corpus(
            args.source, args.tokenizer, args.out, args.num_workers, args.text_field, args.errors,
            args.shard_tokens or DEFAULT_SHARD_TOKENS, show_progress=not args.quiet,
        )  # fmt: skip
    except (CorpusError, PreparationLockError, PreparedDataError, TokenizerNotFoundError, ValueError) as err:
        raise SystemExit(f"prepare-data: {err}") from err
    seconds = time.perf_counter() - started
    megabytes = sum(size for _, size, _ in manifest.fingerprint) / 1e6
    unchanged = " (source unchanged, nothing to do)" if before == manifest_file.stat().st_mtime_ns else ""
    print(
        f"{args.out}{unchanged}: {manifest.tokens} tokens from {manifest.documents} documents "
        f"(tokenizer {manifest.tokenizer}, vocab {manifest.vocab_size}, {manifest.dtype}); "
        f"{megabytes:.1f} MB in {seconds:.1f} s = {megabytes / max(seconds, 1e-9):.1f} MB/s"
    )
