"""Every model preset: exact parameter count (meta device) equal to the published one and to a closed form."""

import re

import pytest

from lightning_hpz.cli import main as cli_main
from lightning_hpz.models import PRESETS, UnknownPresetError, count_parameters, get_preset


def _llama2_count(c: dict) -> int:
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    head = h // c["num_attention_heads"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * head
    attention = 2 * h * h + 2 * h * kv  # q, o; k, v (grouped-query in 70B)
    mlp = 3 * h * c["intermediate_size"]  # gate, up, down (SwiGLU)
    return layers * (attention + mlp + 2 * h) + h + 2 * vocab * h  # 2 RMSNorms per layer; final norm; embed + head


def _falcon_count(c: dict) -> int:
    h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    head = h // heads
    if c["new_decoder_architecture"]:
        qkv, norms = h * (h + 2 * c["num_kv_heads"] * head), 2 * 2 * h  # two LayerNorms (weight + bias)
    else:
        qkv, norms = h * (h + 2 * head), 2 * h  # multi-query: one key and one value head
    per_layer = qkv + h * h + 2 * h * 4 * h + norms
    return layers * per_layer + 2 * h + c["vocab_size"] * h  # final LayerNorm; embedding tied to the head


def _t5_count(c: dict) -> int:
    d, inner, layers = c["d_model"], c["num_heads"] * c["d_kv"], c["num_layers"]
    attention = 4 * d * inner
    ffn = 3 * d * c["d_ff"]  # gated-GELU: wi_0, wi_1, wo
    relative_bias = 32 * c["num_heads"]  # one table per stack, in its first layer
    encoder = layers * (attention + ffn + 2 * d) + relative_bias + d
    decoder = layers * (2 * attention + ffn + 3 * d) + relative_bias + d
    return encoder + decoder + 2 * c["vocab_size"] * d  # shared input embedding + separate lm_head


CLOSED_FORM = {"llama2": _llama2_count, "falcon": _falcon_count, "t5": _t5_count}


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_matches_published_and_closed_form(name):
    preset = PRESETS[name]
    counted = count_parameters(preset)
    assert counted == preset.parameters, f"{name}: architecture gives {counted:,}, source says {preset.parameters:,}"
    assert counted == CLOSED_FORM[preset.family](preset.config)


def test_llama2_7b_count_is_the_published_one():
    assert count_parameters("llama2-7b") == 6_738_415_616


@pytest.mark.parametrize("name", list(PRESETS))
def test_headline_size_is_the_rounded_count(name):
    preset = PRESETS[name]
    number, unit = re.fullmatch(r"([\d.]+)([MB])", preset.headline).groups()
    headline = float(number) * (1e6 if unit == "M" else 1e9)
    assert abs(preset.parameters - headline) / headline < 0.1, (name, preset.parameters, preset.headline)
    assert preset.source


def test_five_encoder_decoder_sizes_for_the_scaling_study():
    sizes = sorted(p.parameters for p in PRESETS.values() if p.family == "t5" and not p.name.endswith("tiny"))
    assert len(sizes) == 5
    assert 570e6 < sizes[0] < 600e6 and 12.5e9 < sizes[-1] < 13.5e9


def test_each_family_has_a_tiny_test_size():
    for family in ("llama2", "falcon", "t5"):
        assert PRESETS[f"{family}-tiny"].parameters < 1_000_000


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(UnknownPresetError, match=r"llama2-7b.*mt5-xxl") as error:
        get_preset("llama3-8b")
    assert "llama3-8b" in str(error.value)


def test_presets_command_prints_every_preset(capsys):
    cli_main(["presets"])
    out = capsys.readouterr().out
    for name, preset in PRESETS.items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert preset.family in line and f"{preset.parameters:,}" in line
