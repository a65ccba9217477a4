"""Where the text comes from: the embedded default corpus or local files (.txt, .jsonl, .parquet, a datasets dir).

A corpus is a list of documents (strings). The default needs no download: the English help topics that ship with
every CPython (``pydoc_data.topics``, about 465 KB), optionally followed by the standard library's own source.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

DEFAULT_CORPUS = "default"
DEFAULT_WITH_SOURCE = "default+stdlib"  # the help text followed by the standard library's .py files
SUPPORTED = ".txt, .jsonl (one JSON object per line with a 'text' field), .parquet (a 'text' column), or a directory "
SUPPORTED += "written by datasets.Dataset.save_to_disk"


class CorpusError(ValueError):
    """A corpus that cannot be read or holds no text."""


def default_corpus(include_stdlib_source: bool = False) -> list[str]:
    """The help topics of this Python's ``pydoc_data`` package, one document per topic, in a fixed order."""
    from pydoc_data.topics import topics

    documents = [topics[key] for key in sorted(topics)]
    if include_stdlib_source:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        documents += [path.read_text(encoding="utf-8", errors="replace") for path in sorted(stdlib.glob("*.py"))]
    return documents


def read_corpus(source: str | Path, text_field: str = "text") -> list[str]:
    """The non-empty documents of ``source``: ``"default"``, ``"default+stdlib"`` or a local path.

    Raises :class:`CorpusError` if there are none.
    """
    if str(source) in (DEFAULT_CORPUS, DEFAULT_WITH_SOURCE):
        documents = default_corpus(include_stdlib_source=str(source) == DEFAULT_WITH_SOURCE)
    else:
        documents = _read_path(Path(source), text_field)
    documents = [doc for doc in documents if doc and doc.strip()]
    if not documents:
        raise CorpusError(f"The corpus {str(source)!r} holds no text. Point `source` at a file with text in it.")
    return documents


def _read_path(path: Path, text_field: str) -> list[str]:
    if not path.exists():
        raise CorpusError(
            f"No corpus at {str(path)!r}. Pass 'default' (or 'default+stdlib') for the embedded corpus, or {SUPPORTED}."
        )
    if path.is_dir():
        return _read_datasets_dir(path, text_field)
    readers = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}
    if path.suffix not in readers:
        raise CorpusError(f"Cannot read {str(path)!r}: unsupported file type {path.suffix!r}. Use {SUPPORTED}.")
    return readers[path.suffix](path, text_field)


def _read_txt(path: Path, text_field: str) -> list[str]:
    # Blank-line separated paragraphs become documents, so packing can put an end-of-text token between them.
    return path.read_text(encoding="utf-8").split("\n\n")


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    documents = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(
                f"{path}:{number} is not valid JSON ({err.msg}); write one JSON object per line."
            ) from err
        if not isinstance(record, dict) or text_field not in record:
            raise CorpusError(f"{path}:{number} has no {text_field!r} field. Set `text_field` to the text's field.")
        documents.append(str(record[text_field]))
    return documents


def _read_parquet(path: Path, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if text_field not in table.column_names:
        raise CorpusError(
            f"{path} has no {text_field!r} column (columns: {table.column_names}). Set `text_field` to the text column."
        )
    return [str(value) for value in table.column(text_field).to_pylist() if value is not None]


def _read_datasets_dir(path: Path, text_field: str) -> list[str]:
    try:
        import datasets
    except ImportError as err:
        raise CorpusError(
            f"{str(path)!r} is a directory, read as a Hugging Face datasets directory, but `datasets` is not "
            "installed. Run `pip install 'lightning-hpz[data]'`, or export the text to .jsonl or .parquet."
        ) from err
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if text_field not in loaded.column_names:
        raise CorpusError(f"{path} has no {text_field!r} column (columns: {loaded.column_names}).")
    return [str(value) for value in loaded[text_field] if value is not None]
