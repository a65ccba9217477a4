"""Data for lightning_hpz's models: corpora, tokenizers, packing, span corruption and LightningDataModules."""

from lightning_hpz.data.causal_lm_datamodule import CausalLMDataModule
from lightning_hpz.data.corpus import CorpusError, default_corpus, iter_documents, read_corpus
from lightning_hpz.data.packing import SequenceTooLongError, pack_tokens
from lightning_hpz.data.preparation import prepare_corpus
from lightning_hpz.data.prepared_shards import PreparedDataError, PreparedShards
from lightning_hpz.data.span_corruption import corrupt_spans, raw_length_for, span_layout
from lightning_hpz.data.span_corruption_datamodule import SpanCorruptionDataModule
from lightning_hpz.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, TokenizerNotFoundError, load_tokenizer
from lightning_hpz.exact_resume.resumable_batches import ResumableBatches

__all__ = [
    "ByteTokenizer",
    "CausalLMDataModule",
    "CorpusError",
    "HuggingFaceTokenizer",
    "PreparedDataError",
    "PreparedShards",
    "ResumableBatches",
    "SequenceTooLongError",
    "SpanCorruptionDataModule",
    "TokenizerNotFoundError",
    "corrupt_spans",
    "default_corpus",
    "iter_documents",
    "load_tokenizer",
    "pack_tokens",
    "prepare_corpus",
    "raw_length_for",
    "read_corpus",
    "span_layout",
]
