"""Corpora: the embedded default, local .txt / .jsonl / .parquet files, and each unreadable input's error."""

import builtins
import json

import pytest

from lightning_hpz.data import CorpusError, default_corpus, read_corpus


def test_default_corpus_is_the_cpython_help_text():
    documents = default_corpus()
    text = "\n".join(documents)
    assert len(text) > 300_000  # ~465 KB in CPython 3.11
    assert text.count(" the ") > 1000  # English prose, not code


def test_default_corpus_can_add_the_standard_library_source():
    plain, with_source = default_corpus(), default_corpus(include_stdlib_source=True)
    assert len(with_source) > len(plain)
    assert any("def " in doc and "import " in doc for doc in with_source[len(plain) :])
    assert read_corpus("default+stdlib") == [doc for doc in with_source if doc.strip()]


def test_reads_txt_jsonl_and_parquet(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph\n\nsecond paragraph\n")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["x y", None, "z"]}), tmp_path / "a.parquet")
    assert read_corpus(tmp_path / "a.txt") == ["first paragraph", "second paragraph\n"]
    assert read_corpus(tmp_path / "a.jsonl") == ["one", "two"]
    assert read_corpus(tmp_path / "a.parquet") == ["x y", "z"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", "\n\n  \n", "holds no text"),
        ("bad.jsonl", '{"text": "ok"}\n{not json\n', r"bad.jsonl:2 is not valid JSON"),
        ("field.jsonl", '{"body": "x"}\n', "has no 'text' field"),
        ("table.csv", "text\nx\n", "unsupported file type '.csv'"),
    ],
)
def test_unreadable_corpus_says_why(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(CorpusError, match=message):
        read_corpus(tmp_path / name)


def test_missing_corpus_names_the_supported_kinds(tmp_path):
    with pytest.raises(CorpusError, match=r"No corpus at .*'default'.*\.jsonl"):
        read_corpus(tmp_path / "nowhere.txt")


def test_datasets_directory_without_datasets_installed(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(CorpusError, match=r"pip install 'lightning-hpz\[data\]'"):
        read_corpus(tmp_path)
