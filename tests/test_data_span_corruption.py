"""T5 span corruption: exact lengths, and every input token kept or covered by exactly one sentinel span."""

import pytest
import torch

from lightning_hpz.data import ByteTokenizer, SpanCorruptionDataModule, corrupt_spans, raw_length_for, span_layout
from lightning_hpz.data.span_corruption import random_segmentation

TOKENIZER = ByteTokenizer()
SENTINELS = TOKENIZER.sentinel_ids(100)


def _reconstruct(inputs: list[int], targets: list[int]) -> list[int]:
    """Put each sentinel's span from the target back in place of the sentinel in the input."""
    spans, current = {}, None
    for token in targets[:-1]:
        if token in SENTINELS:
            current = token
            spans[current] = []
        else:
            spans[current].append(token)
    out = []
    for token in inputs[:-1]:
        out.extend(spans.pop(token) if token in SENTINELS else [token])
    assert not spans, "a target span has no sentinel in the input"
    return out


@pytest.mark.parametrize("input_length", [3, 4, 17, 64, 128, 512, 568])
def test_raw_length_gives_exactly_the_requested_input_length(input_length):
    layout = raw_length_for(input_length)
    assert layout.input_length == input_length
    assert span_layout(layout.raw_length + 1).input_length > input_length  # the longest block that fits


@pytest.mark.parametrize("seed", range(20))
def test_every_token_is_kept_or_in_exactly_one_span(seed):
    generator = torch.Generator().manual_seed(seed)
    layout = raw_length_for(int(torch.randint(8, 600, (1,), generator=generator)))
    tokens = torch.randint(3, 259, (layout.raw_length,), generator=generator)
    inputs, targets = corrupt_spans(tokens, SENTINELS, TOKENIZER.eos_id, generator)
    assert len(inputs) == layout.input_length and len(targets) == layout.target_length
    assert inputs[-1] == targets[-1] == TOKENIZER.eos_id
    used = [t for t in inputs.tolist() if t in SENTINELS]
    assert used == SENTINELS[: layout.spans] == [t for t in targets.tolist() if t in SENTINELS]
    assert _reconstruct(inputs.tolist(), targets.tolist()) == tokens.tolist()


def test_noise_density_and_mean_span_length():
    generator = torch.Generator().manual_seed(0)
    layout = raw_length_for(512)
    assert abs(layout.noise_tokens / layout.raw_length - 0.15) < 0.01
    assert abs(layout.noise_tokens / layout.spans - 3.0) < 0.5
    lengths = [length for _ in range(200) for length in random_segmentation(77, 26, generator)]
    assert min(lengths) >= 1 and abs(sum(lengths) / len(lengths) - 77 / 26) < 1e-9


def test_datamodule_examples_fit_exactly(tmp_path):
    datamodule = SpanCorruptionDataModule(input_length=64, cache_dir=str(tmp_path))
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    inputs, labels = batch["input_ids"], batch["labels"]
    assert inputs.shape[1] == 64 and labels.shape[1] == datamodule.layout.target_length
    assert datamodule.sequence_length == 64
    assert (inputs != TOKENIZER.pad_id).all() and (labels != TOKENIZER.pad_id).all()  # no padding anywhere
