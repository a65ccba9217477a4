"""T5 span corruption: drop random spans of a sequence, replace each by a sentinel, and predict the spans.

With noise density ``d`` and mean span length ``m``, a raw block of ``n`` tokens has ``round(n * d)`` noise tokens in
``round(noise / m)`` spans. The input keeps the other tokens plus one sentinel per span and an end token, the target
holds one sentinel per span followed by its tokens, and an end token. Both lengths depend on ``n`` only, so
:func:`raw_length_for` picks the ``n`` whose corrupted input is exactly the requested length: packed examples fit
with no padding.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0


@dataclass(frozen=True)
class SpanLayout:
    """How a raw block of ``raw_length`` tokens splits, and the lengths of the resulting input and target."""

    raw_length: int
    noise_tokens: int
    spans: int

    @property
    def kept_tokens(self) -> int:
        return self.raw_length - self.noise_tokens

    @property
    def input_length(self) -> int:
        return self.kept_tokens + self.spans + 1  # one sentinel per span, one end token

    @property
    def target_length(self) -> int:
        return self.noise_tokens + self.spans + 1


def span_layout(
    raw_length: int, noise_density: float = NOISE_DENSITY, mean_span: float = MEAN_SPAN_LENGTH
) -> SpanLayout:
    """The split of a raw block of ``raw_length`` tokens (at least 2)."""
    noise = min(max(round(raw_length * noise_density), 1), raw_length - 1)
    spans = max(1, round(noise / mean_span))
    return SpanLayout(raw_length, noise, spans)


def raw_length_for(
    input_length: int, noise_density: float = NOISE_DENSITY, mean_span: float = MEAN_SPAN_LENGTH
) -> SpanLayout:
    """The layout of the longest raw block whose corrupted input has exactly ``input_length`` tokens.

    The input length grows by 0 or 1 per extra raw token, so every length from 3 upwards is reached exactly.
    """
    if input_length < 3:
        raise ValueError(f"input length {input_length} is too short for span corruption; use at least 3.")
    raw = 2
    while span_layout(raw + 1, noise_density, mean_span).input_length <= input_length:
        raw += 1
    layout = span_layout(raw, noise_density, mean_span)
    assert layout.input_length == input_length, layout
    return layout


def random_segmentation(total: int, segments: int, generator: torch.Generator) -> list[int]:
    """``segments`` positive lengths summing to ``total``, uniformly over all such compositions."""
    cuts = (torch.randperm(total - 1, generator=generator)[: segments - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


def corrupt_spans(
    tokens: torch.Tensor,
    sentinel_ids: list[int],
    eos_id: int,
    generator: torch.Generator,
    noise_density: float = NOISE_DENSITY,
    mean_span: float = MEAN_SPAN_LENGTH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of one raw 1-D block; spans alternate kept, noise, kept, noise ... (first token kept)."""
    layout = span_layout(tokens.numel(), noise_density, mean_span)
    if layout.spans > len(sentinel_ids):
        raise ValueError(f"{layout.spans} spans need as many sentinel ids; {len(sentinel_ids)} given.")
    kept_lengths = random_segmentation(layout.kept_tokens, layout.spans, generator)
    noise_lengths = random_segmentation(layout.noise_tokens, layout.spans, generator)
    inputs: list[int] = []
    targets: list[int] = []
    position = 0
    values = tokens.tolist()
    for sentinel, kept, noise in zip(sentinel_ids[: layout.spans], kept_lengths, noise_lengths, strict=True):
        inputs += [*values[position : position + kept], sentinel]
        position += kept
        targets += [sentinel, *values[position : position + noise]]
        position += noise
    return torch.tensor([*inputs, eos_id]), torch.tensor([*targets, eos_id])
