"""FLOPs per batch from the architecture against torch's FLOP counter, token counting, and the peak FLOP/s table."""

import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops

from lightning_hpz.callbacks.batch_tokens import _detect_batch_tokens
from lightning_hpz.callbacks.model_flops import shape_from_config, training_flops, training_flops_per_token
from lightning_hpz.callbacks.peak_flops import PEAK_FLOPS, chip_key, measure_matmul_flops, table_peak_flops

transformers = pytest.importorskip("transformers")
BATCH, SEQ, TARGET, VOCAB = 2, 48, 20, 384

TINY_CONFIGS = {
    "llama (GQA)": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "falcon-7b style (multi-query)": lambda: transformers.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        multi_query=True,
        new_decoder_architecture=False,
    ),
    "falcon-40b style (grouped kv)": lambda: transformers.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_kv_heads=2,
        new_decoder_architecture=True,
    ),
    "t5 (gated, deeper decoder)": lambda: transformers.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
    ),
}


def measured_training_flops(config) -> int:
    model_class = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(config)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        labels = torch.randint(0, VOCAB, (BATCH, TARGET)) if config.is_encoder_decoder else ids
    return measure_flops(model, lambda: model(input_ids=ids, labels=labels).loss, lambda loss: loss)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_training_flops_match_torch_flop_counter(family):
    config = TINY_CONFIGS[family]()
    target = TARGET if config.is_encoder_decoder else None
    predicted = training_flops(shape_from_config(config), BATCH, SEQ, target)
    assert predicted == pytest.approx(measured_training_flops(config), rel=0.10)


def test_per_token_flops_approach_six_n_for_short_sequences():
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32
    )
    shape = shape_from_config(config)
    matmul_weights = 32 * (shape.self_attention_weights() + shape.mlp_weights()) + 4096 * 32000
    assert training_flops_per_token(shape, 1) == pytest.approx(6 * matmul_weights, rel=1e-3)
    # Attention adds 12 L s d_attn per token (Chinchilla, Appendix F):
    extra = training_flops_per_token(shape, 4096) - training_flops_per_token(shape, 1)
    assert extra == pytest.approx(12 * 32 * (4096 - 1) * 4096)


def test_config_without_sizes_is_refused():
    with pytest.raises(ValueError, match="flops_per_token"):
        shape_from_config({"vocab_size": 10})
    with pytest.raises(ValueError, match="target_len"):
        training_flops(shape_from_config(TINY_CONFIGS["t5 (gated, deeper decoder)"]()), 1, 8)


def test_tokens_counted_by_attention_mask():
    ids = torch.ones(3, 10, dtype=torch.long)
    mask = torch.zeros(3, 10, dtype=torch.long)
    mask[0, :10], mask[1, :4], mask[2, :1] = 1, 1, 1
    counts = _detect_batch_tokens({"input_ids": ids, "attention_mask": mask})
    assert (counts.samples, counts.real_tokens, counts.input_positions) == (3, 15, 10)
    assert _detect_batch_tokens(ids).real_tokens == 30  # no mask: every position is real
    labels = torch.full((3, 6), -100)
    labels[:, :2] = 5
    seq2seq = _detect_batch_tokens({"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert (seq2seq.real_tokens, seq2seq.target_positions) == (15 + 6, 6)
    with pytest.raises(ValueError, match="tokens_fn"):
        _detect_batch_tokens({"pixels": 3})


def test_peak_flops_table_holds_only_chips_lightning_lacks():
    assert chip_key("NVIDIA H200") == "h200 sxm"
    assert chip_key("NVIDIA H200 NVL") == "h200 nvl"
    assert chip_key("NVIDIA L40S") == "l40s"
    assert chip_key("AMD Instinct MI300X") == "mi300x"
    assert chip_key("NVIDIA H100 80GB HBM3") is None  # Lightning's table answers for it
    assert table_peak_flops("NVIDIA H200", torch.bfloat16) == PEAK_FLOPS["h200 sxm"]["bfloat16"]
    for row in PEAK_FLOPS.values():  # tensor cores: bf16 doubles tf32, which beats plain fp32
        assert row["bfloat16"] == pytest.approx(2 * row["tf32"], rel=0.02)
        assert row["tf32"] > row["float32"]


def test_cpu_peak_is_measured():
    assert measure_matmul_flops(size=128, repeats=2) > 0
