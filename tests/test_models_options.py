"""Training options: weight-decay groups, warmup + cosine, activation checkpointing, data/model checks, perplexity."""

import itertools
import math

import lightning as L
import pytest
import torch

from lightning_hpz.data import ByteTokenizer, CausalLMDataModule
from lightning_hpz.models import DataModelMismatchError, Falcon, Llama2, check_data_fits_model
from lightning_hpz.models.optimization import warmup_cosine, weight_decay_groups


def test_no_weight_decay_on_norms_biases_and_embeddings():
    module = Falcon(preset="falcon-tiny")  # LayerNorms with biases, tied embedding
    module.configure_model()
    decay, no_decay = weight_decay_groups(module.model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    exempt = {id(p) for p in no_decay["params"]}
    for name, param in module.model.named_parameters():
        expected = param.ndim < 2 or "word_embeddings" in name
        assert (id(param) in exempt) == expected, name
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.model.parameters()))


def test_warmup_then_cosine_to_the_floor():
    schedule = warmup_cosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    values = [schedule(step) for step in range(111)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(values[9:]))
    assert values[110] == pytest.approx(0.1) and values[60] == pytest.approx(0.55)
    assert warmup_cosine(10, math.inf)(500) == 1.0


def _checkpointing(model) -> bool:
    renamed = hasattr(model, "activation_checkpointing_enable")  # transformers 5
    return model.is_activation_checkpointing if renamed else model.is_gradient_checkpointing


def test_activation_checkpointing_changes_no_gradient():
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        module = Llama2(preset="llama2-tiny", activation_checkpointing=checkpointing)
        module.configure_model()
        assert _checkpointing(module.model) == checkpointing
        ids = torch.randint(3, 259, (2, 32), generator=torch.Generator().manual_seed(0))
        module.train()
        module(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_sequence_longer_than_the_positions_or_vocabulary_too_large():
    config = Llama2(preset="llama2-tiny").hf_config
    check_data_fits_model(config, vocab_size=ByteTokenizer().vocab_size, sequence_length=256)
    with pytest.raises(DataModelMismatchError, match="longer than the model's 256 positions"):
        check_data_fits_model(config, vocab_size=300, sequence_length=257)
    with pytest.raises(DataModelMismatchError, match="tokenizer has 32000 tokens but the model's vocabulary has 384"):
        check_data_fits_model(config, vocab_size=32000, sequence_length=128)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs
    )


def test_fit_refuses_data_the_model_cannot_take(tmp_path):
    data = CausalLMDataModule(sequence_length=512, cache_dir=str(tmp_path))
    with pytest.raises(DataModelMismatchError, match="sequence_length=512"):
        _trainer(max_steps=1).fit(Llama2(preset="llama2-tiny"), data)


def test_validation_perplexity_is_exp_of_the_token_loss(tmp_path):
    torch.manual_seed(0)
    data = CausalLMDataModule(sequence_length=64, batch_size=4, cache_dir=str(tmp_path))
    (metrics,) = _trainer(limit_val_batches=3).validate(Llama2(preset="llama2-tiny"), data)
    assert metrics["val_perplexity"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-4)
    assert 100 < metrics["val_perplexity"] < 2000  # untrained: close to the vocabulary size (384)
