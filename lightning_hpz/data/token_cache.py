"""Small sources need no explicit step: they are prepared on first use into a cache directory, then read as shards.

The cache directory is named after what decides the tokens (source path, tokenizer, text field, decode errors);
inside it, :func:`~lightning_hpz.data.preparation.prepare_corpus` re-prepares only when the source's files changed
(size or modification time), so no text is hashed on start-up.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lightning_hpz.data.corpus import is_default
from lightning_hpz.data.tokenizers import Tokenizer


def cache_directory(source: str | Path, tokenizer: Tokenizer, text_field: str, errors: str, cache_dir: Path) -> Path:
    """The directory ``source`` is prepared into: it changes with the source's location, tokenizer and options."""
    where = str(source) if is_default(source) else str(Path(source).resolve())
    identity = json.dumps([where, tokenizer.name, text_field, errors]).encode()
    return Path(cache_dir) / f"{Path(where).name}-{tokenizer.name}-{hashlib.sha256(identity).hexdigest()[:16]}"


def prepare_into_cache(
    source: str | Path, tokenizer_spec: str, tokenizer: Tokenizer, text_field: str, errors: str, cache_dir: Path
) -> Path:
    """Prepare ``source`` into its cache directory (in this process, once) and return that directory."""
    from lightning_hpz.data.preparation import prepare_corpus

    directory = cache_directory(source, tokenizer, text_field, errors, cache_dir)
    prepare_corpus(source, tokenizer_spec, directory, num_workers=1, text_field=text_field, errors=errors)
    return directory
