"""Named model sizes as data, each with the source of its numbers, and their exact parameter counts.

A preset is a family plus the keyword arguments of its transformers config. ``parameters`` is the published exact
count of the released checkpoint (unique weights, a tied matrix counted once); :func:`count_parameters` recomputes it
from the architecture on the meta device, so a wrong preset shows up as a mismatch (tests/test_presets.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class UnknownPresetError(KeyError):
    """A preset name that is not in :data:`PRESETS`."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


@dataclass(frozen=True)
class ModelPreset:
    """One model size.

    Attributes:
        name: what users type, e.g. ``"llama2-7b"``.
        family: ``"llama2"``, ``"falcon"`` or ``"t5"``.
        config: keyword arguments of the family's transformers config.
        parameters: exact parameter count the source publishes (or, for test sizes, the one the tests derive).
        headline: the rounded size the paper or model card names it by.
        source: where the numbers come from.
    """

    name: str
    family: str
    config: dict[str, Any]
    parameters: int
    headline: str
    source: str
    notes: str = field(default="", compare=False)


_LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
_LLAMA2_SOURCE = (
    "Touvron et al. 2023, Llama 2 (arXiv 2307.09288), Table 1 and the config.json of meta-llama/{repo}; "
    "exact count: safetensors metadata of meta-llama/{repo}"
)
_FALCON_SOURCE = (
    "config.json of tiiuae/{repo}; Almazrouei et al. 2023, The Falcon Series (arXiv 2311.16867). Exact count is the "
    "unique weights (lm_head is tied to the embedding; the Hub's {hub} counts that matrix twice)"
)
_T5 = dict(feed_forward_proj="gated-gelu", d_kv=64, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
_MT5_SOURCE = (
    "Xue et al. 2021, mT5 (arXiv 2010.11934), Table 1 ({headline}) and the config.json of google/{repo}; "
    "exact count: parameters of google/{repo} (untied lm_head)"
)
# Test sizes: small enough to train on CPU in seconds, with every feature of the big ones (GQA, multi-query, ...).
# Their vocabulary holds the byte tokenizer (3 specials + 256 bytes + 100 sentinels).
_TINY_VOCAB = 384

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in [
        ModelPreset(
            "llama2-tiny",
            "llama2",
            dict(
                vocab_size=_TINY_VOCAB,
                hidden_size=64,
                intermediate_size=176,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
            ),
            parameters=141_632,
            headline="0.14M",
            source="lightning_hpz test size (Llama-2 architecture with GQA as in 70B); count derived in tests",
        ),
        ModelPreset(
            "llama2-7b",
            "llama2",
            dict(_LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
            parameters=6_738_415_616,
            headline="7B",
            source=_LLAMA2_SOURCE.format(repo="Llama-2-7b-hf"),
        ),
        ModelPreset(
            "llama2-13b",
            "llama2",
            dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40),
            parameters=13_015_864_320,
            headline="13B",
            source=_LLAMA2_SOURCE.format(repo="Llama-2-13b-hf"),
        ),
        ModelPreset(
            "llama2-70b",
            "llama2",
            dict(
                _LLAMA2,
                hidden_size=8192,
                intermediate_size=28672,
                num_hidden_layers=80,
                num_attention_heads=64,
                num_key_value_heads=8,
            ),
            parameters=68_976_648_192,
            headline="70B",
            source=_LLAMA2_SOURCE.format(repo="Llama-2-70b-hf"),
        ),
        ModelPreset(
            "falcon-tiny",
            "falcon",
            dict(
                vocab_size=_TINY_VOCAB,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                multi_query=True,
                parallel_attn=True,
                new_decoder_architecture=False,
                bias=False,
                max_position_embeddings=256,
            ),
            parameters=110_976,
            headline="0.11M",
            source="lightning_hpz test size (Falcon-7B layout: multi-query, parallel attn); count derived in tests",
        ),
        ModelPreset(
            "falcon-7b",
            "falcon",
            dict(
                vocab_size=65024,
                hidden_size=4544,
                num_hidden_layers=32,
                num_attention_heads=71,
                multi_query=True,
                parallel_attn=True,
                new_decoder_architecture=False,
                bias=False,
                max_position_embeddings=2048,
            ),
            parameters=6_921_720_704,
            headline="7B",
            source=_FALCON_SOURCE.format(repo="falcon-7b", hub="7.22B"),
        ),
        ModelPreset(
            "falcon-40b",
            "falcon",
            dict(
                vocab_size=65024,
                hidden_size=8192,
                num_hidden_layers=60,
                num_attention_heads=128,
                num_kv_heads=8,
                new_decoder_architecture=True,
                parallel_attn=True,
                bias=False,
                max_position_embeddings=2048,
            ),
            parameters=41_303_293_952,
            headline="40B",
            source=_FALCON_SOURCE.format(repo="falcon-40b", hub="41.8B"),
        ),
        ModelPreset(
            "t5-tiny",
            "t5",
            dict(_T5, vocab_size=_TINY_VOCAB, d_model=64, d_ff=160, num_layers=2, num_heads=4, d_kv=16),
            parameters=271_360,
            headline="0.27M",
            source="lightning_hpz test size (T5 v1.1 architecture: gated-GELU, untied lm_head); count derived in tests",
        ),
        ModelPreset(
            "mt5-base",
            "t5",
            dict(_T5, vocab_size=250112, d_model=768, d_ff=2048, num_layers=12, num_heads=12),
            parameters=582_401_280,
            headline="580M",
            source=_MT5_SOURCE.format(headline="580M", repo="mt5-base"),
        ),
        ModelPreset(
            "mt5-large",
            "t5",
            dict(_T5, vocab_size=250112, d_model=1024, d_ff=2816, num_layers=24, num_heads=16),
            parameters=1_229_581_312,
            headline="1.2B",
            source=_MT5_SOURCE.format(headline="1.2B", repo="mt5-large"),
        ),
        ModelPreset(
            "t5-v1_1-xl",
            "t5",
            dict(_T5, vocab_size=32128, d_model=2048, d_ff=5120, num_layers=24, num_heads=32),
            parameters=2_849_757_184,
            headline="3B",
            source=(
                "config.json of google/t5-v1_1-xl (T5 v1.1 = the mT5 architecture with the 32k English vocabulary; "
                "Raffel et al. 2020, arXiv 1910.10683, released_checkpoints.md 'T5 1.1')"
            ),
            notes=(
                "fifth size of the 580M-13B scaling study (arXiv 2310.05350): mT5 has only four sizes in that range "
                "(mT5-small is 300M), and T5 v1.1 XL is the same encoder-decoder between mT5-large and mT5-XL"
            ),
        ),
        ModelPreset(
            "mt5-xl",
            "t5",
            dict(_T5, vocab_size=250112, d_model=2048, d_ff=5120, num_layers=24, num_heads=32),
            parameters=3_742_619_648,
            headline="3.7B",
            source=_MT5_SOURCE.format(headline="3.7B", repo="mt5-xl"),
        ),
        ModelPreset(
            "mt5-xxl",
            "t5",
            dict(_T5, vocab_size=250112, d_model=4096, d_ff=10240, num_layers=24, num_heads=64),
            parameters=12_921_057_280,
            headline="13B",
            source=_MT5_SOURCE.format(headline="13B", repo="mt5-xxl"),
        ),
    ]
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``, or an error that lists the known ones."""
    if name not in PRESETS:
        raise UnknownPresetError(f"Unknown model preset {name!r}. Known presets: {', '.join(PRESETS)}.")
    return PRESETS[name]


def count_parameters(preset: ModelPreset | str) -> int:
    """Exact count of unique parameters, built on the meta device: no memory is allocated for the weights."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    if PRESETS.get(preset.name) is preset:
        return _count_named(preset.name)
    return _count(preset)


@functools.cache
def _count_named(name: str) -> int:
    return _count(PRESETS[name])  # building a 70B model's layers on the meta device still takes a second


def _count(preset: ModelPreset) -> int:
    import torch  # here, not at the top: listing the presets needs neither torch nor transformers

    from lightning_hpz.models.architectures import build_hf_model, hf_config

    with torch.device("meta"):
        model = build_hf_model(preset.family, hf_config(preset.family, preset.config))
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once


def print_presets(argv: Sequence[str] = ()) -> None:
    """``lightning-hpz presets``: name, family, exact parameter count and headline size of every preset.

    The counts are the published ones, which tests/test_presets.py checks against a meta-device build of each preset
    (``count_parameters``); printing them needs no torch, so the command answers at once.
    """
    print(f"{'preset':<12} {'family':<7} {'parameters':>15}  size")
    for preset in PRESETS.values():
        print(f"{preset.name:<12} {preset.family:<7} {preset.parameters:>15,}  {preset.headline}")
