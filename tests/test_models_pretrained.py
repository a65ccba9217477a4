"""Forward parity with the bare transformers models, local pretrained directories, export, and their errors."""

import json
import math

import pytest
import torch
from transformers import FalconForCausalLM, LlamaForCausalLM, MT5ForConditionalGeneration

from lightning_hpz.models import T5, Falcon, Llama2, PretrainedModelError, UnknownPresetError

FAMILIES = [
    (Llama2, "llama2-tiny", LlamaForCausalLM),
    (Falcon, "falcon-tiny", FalconForCausalLM),
    (T5, "t5-tiny", MT5ForConditionalGeneration),
]
INPUTS = {"input_ids": torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(0))}


def _logits(model, family_class) -> torch.Tensor:
    inputs = dict(INPUTS)
    if family_class is T5:
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :12]
    with torch.no_grad():
        return model.eval()(**inputs).logits


def _saved_model(family_class, preset, directory, seed=1):
    """A randomly initialised model of the preset, saved as a Hugging Face directory."""
    torch.manual_seed(seed)
    module = family_class(preset=preset)
    module.configure_model()
    module.export(str(directory))
    return module


@pytest.mark.parametrize(("family_class", "preset", "hf_class"), FAMILIES)
def test_pretrained_logits_equal_the_bare_transformers_model(tmp_path, family_class, preset, hf_class):
    _saved_model(family_class, preset, tmp_path)
    bare = hf_class.from_pretrained(tmp_path)
    ours = family_class(pretrained=str(tmp_path))
    ours.configure_model()
    assert torch.equal(_logits(ours, family_class), _logits(bare, family_class))


@pytest.mark.parametrize(("family_class", "preset", "hf_class"), FAMILIES)
def test_export_round_trips_the_weights(tmp_path, family_class, preset, hf_class):
    original = _saved_model(family_class, preset, tmp_path / "first")
    reloaded = family_class(pretrained=str(tmp_path / "first"))
    reloaded.configure_model()
    reloaded.export(str(tmp_path / "second"))
    again = hf_class.from_pretrained(tmp_path / "second")
    assert torch.equal(_logits(again, family_class), _logits(original.model, family_class))
    assert sum(p.numel() for p in again.parameters()) == sum(p.numel() for p in original.parameters())


def test_t5_keeps_its_own_output_projection(tmp_path):
    module = _saved_model(T5, "t5-tiny", tmp_path)
    assert module.model.lm_head.weight is not module.model.shared.weight
    assert module.model.encoder.embed_tokens.weight is module.model.shared.weight


def test_t5_from_scratch_draws_its_output_projection_by_fan_in(tmp_path):
    # transformers draws it with std 1 (pre-training then starts at a loss of 36-84); t5x scales it by fan-in
    module = _saved_model(T5, "t5-tiny", tmp_path)
    d_model = module.hf_config.d_model
    assert module.model.lm_head.weight.std().item() == pytest.approx(d_model**-0.5, rel=0.05)
    with torch.no_grad():
        loss = module(input_ids=INPUTS["input_ids"], labels=INPUTS["input_ids"]).loss.item()
    vocabulary = module.hf_config.vocab_size
    assert abs(loss - math.log(vocabulary)) < 0.2 * math.log(vocabulary), loss


def test_t5_load_keeps_the_output_projection_it_reads(tmp_path):
    saved = _saved_model(T5, "t5-tiny", tmp_path / "scaled")
    with torch.no_grad():
        saved.model.lm_head.weight.normal_(std=1.0)  # as in a checkpoint made from transformers' own init
    saved.export(str(tmp_path / "std1"))
    loaded = T5(pretrained=str(tmp_path / "std1"))
    loaded.configure_model()
    assert torch.equal(loaded.model.lm_head.weight, saved.model.lm_head.weight)
    assert torch.equal(_logits(loaded, T5), _logits(saved, T5))


def test_unknown_preset_and_wrong_family():
    with pytest.raises(UnknownPresetError, match="Known presets: llama2-tiny"):
        Llama2(preset="llama2-8b")
    with pytest.raises(ValueError, match="'t5-tiny' is a t5 model; Llama2 trains llama2 models"):
        Llama2(preset="t5-tiny")
    with pytest.raises(ValueError, match="needs `preset=`"):
        Falcon()


def test_missing_or_malformed_pretrained_directory(tmp_path):
    with pytest.raises(PretrainedModelError, match="is not a directory"):
        Llama2(pretrained=str(tmp_path / "missing"))
    with pytest.raises(PretrainedModelError, match=r"has no config\.json"):
        Llama2(pretrained=str(tmp_path))
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(PretrainedModelError, match="cannot be read as a transformers config"):
        Llama2(pretrained=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PretrainedModelError, match=r"no \*.safetensors weights"):
        Llama2(pretrained=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(PretrainedModelError, match="model_type='bert'"):
        Llama2(pretrained=str(tmp_path))


def test_weights_that_do_not_fit_the_config(tmp_path):
    _saved_model(Llama2, "llama2-tiny", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] += 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    module = Llama2(pretrained=str(tmp_path))
    with pytest.raises(PretrainedModelError, match=r"shape mismatches \['model.layers.0.mlp"):
        module.configure_model()
