"""Where the text comes from: the embedded default corpus or local files (.txt, .jsonl, .parquet, a datasets dir).

A corpus is a stream of documents (strings), read lazily so that a corpus far larger than memory can be tokenized.
The default needs no download: the English help topics that ship with every CPython (``pydoc_data.topics``, about
465 KB), optionally followed by the standard library's own source.
"""

from __future__ import annotations

import codecs
import json
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_CORPUS = "default"
DEFAULT_WITH_SOURCE = "default+stdlib"  # the help text followed by the standard library's .py files
SUPPORTED = ".txt, .jsonl (one JSON object per line with a 'text' field), .parquet (a 'text' column), or a directory "
SUPPORTED += "written by datasets.Dataset.save_to_disk"
DECODE_ERRORS = ("strict", "replace", "ignore")
READ_CHUNK_BYTES = 1 << 20

# Called with the number of source bytes consumed since the last call (drives the progress bar).
Progress = Callable[[int], None]


class CorpusError(ValueError):
    """A corpus that cannot be read or holds no text."""


def default_corpus(include_stdlib_source: bool = False) -> list[str]:
    """The help topics of this Python's ``pydoc_data`` package, one document per topic, in a fixed order."""
    from pydoc_data.topics import topics

    documents = [topics[key] for key in sorted(topics)]
    if include_stdlib_source:
        documents += [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_source_files()]
    return documents


def stdlib_source_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def is_default(source: str | Path) -> bool:
    return str(source) in (DEFAULT_CORPUS, DEFAULT_WITH_SOURCE)


def read_corpus(source: str | Path, text_field: str = "text", errors: str = "strict") -> list[str]:
    """The non-empty documents of ``source`` as a list (small corpora; see :func:`iter_documents` for large ones)."""
    documents = list(iter_documents(source, text_field, errors))
    if not documents:
        raise CorpusError(f"The corpus {str(source)!r} holds no text. Point `source` at a file with text in it.")
    return documents


def iter_documents(
    source: str | Path, text_field: str = "text", errors: str = "strict", progress: Progress | None = None
) -> Iterator[str]:
    """The non-empty documents of ``source`` (``"default"``, ``"default+stdlib"`` or a local path), one at a time.

    ``errors`` says what to do with bytes that are not UTF-8: ``"strict"`` (raise, naming the file and byte offset),
    ``"replace"`` (U+FFFD) or ``"ignore"`` (drop them).
    """
    if errors not in DECODE_ERRORS:
        raise CorpusError(f"errors={errors!r}: choose one of {DECODE_ERRORS}.")
    report = progress or (lambda _: None)
    if is_default(source):
        documents: Iterator[str] = _reported(default_corpus(str(source) == DEFAULT_WITH_SOURCE), report)
    else:
        documents = _read_path(Path(source), text_field, errors, report)
    return (doc for doc in documents if doc and doc.strip())


def _reported(documents: list[str], progress: Progress) -> Iterator[str]:
    for doc in documents:
        progress(len(doc))
        yield doc


def _read_path(path: Path, text_field: str, errors: str, progress: Progress) -> Iterator[str]:
    if not path.exists():
        raise CorpusError(
            f"No corpus at {str(path)!r}. Pass 'default' (or 'default+stdlib') for the embedded corpus, or {SUPPORTED}."
        )
    if path.is_dir():
        return _read_datasets_dir(path, text_field, progress)
    if path.suffix == ".parquet":
        return _read_parquet(path, text_field, progress)
    if path.suffix == ".txt":
        return _read_txt(path, errors, progress)
    if path.suffix == ".jsonl":
        return _read_jsonl(path, text_field, errors, progress)
    raise CorpusError(f"Cannot read {str(path)!r}: unsupported file type {path.suffix!r}. Use {SUPPORTED}.")


def _read_txt(path: Path, errors: str, progress: Progress) -> Iterator[str]:
    # Blank-line separated paragraphs become documents, so packing can put an end-of-text token between them. Splitting
    # the remainder carried over from the previous chunk gives exactly what str.split("\n\n") on the whole file gives.
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    remainder = ""
    fed = 0  # bytes handed to the decoder so far
    with path.open("rb") as file:
        while chunk := file.read(READ_CHUNK_BYTES):
            remainder += _decode(decoder, chunk, path, fed)
            fed += len(chunk)
            progress(len(chunk))
            *documents, remainder = remainder.split("\n\n")
            yield from documents
    yield remainder + _decode(decoder, b"", path, fed, final=True)


def _decode(decoder: codecs.IncrementalDecoder, data: bytes, path: Path, fed: int, final: bool = False) -> str:
    start = fed - len(decoder.getstate()[0])  # file offset of the first byte the decoder still holds
    try:
        return decoder.decode(data, final)
    except UnicodeDecodeError as err:
        raise _not_utf8(path, start + err.start, err) from err


def _not_utf8(path: Path, offset: int, err: UnicodeDecodeError, line: int | None = None) -> CorpusError:
    where = f"{path}:{line}" if line is not None else str(path)
    return CorpusError(
        f"{where} is not UTF-8 at byte offset {offset} ({err.reason}). Convert the file to UTF-8, or pass "
        "errors='replace' (U+FFFD for bad bytes) or errors='ignore' (drop them) to accept it."
    )


def _read_jsonl(path: Path, text_field: str, errors: str, progress: Progress) -> Iterator[str]:
    offset = 0
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            progress(len(raw))
            try:
                line = raw.decode("utf-8", errors)
            except UnicodeDecodeError as err:
                raise _not_utf8(path, offset + err.start, err, line=number) from err
            offset += len(raw)
            if line.strip():
                yield _text_of(json_record(line, path, number), text_field, path, number)


def json_record(line: str, path: Path, number: int) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise CorpusError(f"{path}:{number} is not valid JSON ({err.msg}); write one JSON object per line.") from err


def _text_of(record: object, text_field: str, path: Path, number: int) -> str:
    if not isinstance(record, dict) or text_field not in record:
        raise CorpusError(f"{path}:{number} has no {text_field!r} field. Set `text_field` to the text's field.")
    text = record[text_field]
    if not isinstance(text, str):
        raise CorpusError(
            f"{path}:{number}: {text_field!r} is {type(text).__name__} ({json.dumps(text)[:60]}), not a string. "
            "Write the document's text as a JSON string, or remove the line."
        )
    return text


def _read_parquet(path: Path, text_field: str, progress: Progress) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    names = file.schema_arrow.names
    if text_field not in names:
        raise CorpusError(
            f"{path} has no {text_field!r} column (columns: {names}). Set `text_field` to the text column."
        )
    column_type = file.schema_arrow.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise CorpusError(f"{path}: column {text_field!r} holds {column_type}, not text. Point `text_field` at text.")
    size, rows = path.stat().st_size, max(file.metadata.num_rows, 1)
    for batch in file.iter_batches(columns=[text_field], batch_size=4096):
        progress(size * batch.num_rows // rows)
        yield from (value for value in batch.column(0).to_pylist() if value is not None)


def _read_datasets_dir(path: Path, text_field: str, progress: Progress) -> Iterator[str]:
    try:
        import datasets
    except ImportError as err:
        raise CorpusError(
            f"{str(path)!r} is a directory, read as a Hugging Face datasets directory, but `datasets` is not "
            "installed. Run `pip install 'lightning-hpz[data]'`, or export the text to .jsonl or .parquet."
        ) from err
    loaded = datasets.load_from_disk(str(path))  # memory-mapped Arrow: rows are read as they are iterated
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if text_field not in loaded.column_names:
        raise CorpusError(f"{path} has no {text_field!r} column (columns: {loaded.column_names}).")
    for batch in loaded.iter(batch_size=4096):
        texts = batch[text_field]
        progress(sum(len(text) for text in texts if text is not None))
        yield from (text for text in texts if text is not None)
