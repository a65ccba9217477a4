"""Training FLOPs of a transformer from its architecture: 6N plus attention, decoder-only and encoder-decoder.

Counted like ``torch.utils.flop_counter`` (which :func:`lightning.fabric.utilities.throughput.measure_flops` uses):
only matrix multiplications, 2 FLOPs per multiply-add; attention scores and the weighted sum over the full ``s x s``
square (a causal mask saves nothing there); backward = 2 x forward, so training = 3 x forward. Per token and layer the
forward pass costs ``2 x (matmul weights)`` plus ``4 x s x d_attn`` for attention (Kaplan et al. 2020, arXiv
2001.08361, Table 1; Hoffmann et al. 2022, arXiv 2203.15556, Appendix F). Embedding lookups, norms and activations
are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

# MLPs with two matrices (up, down); every other family is taken to have a gated MLP (gate, up, down).
_PLAIN_MLP_FAMILIES = ("falcon", "gpt2", "gpt_neox", "gptj", "opt", "bloom", "phi", "bert", "starcoder2")


@dataclass(frozen=True)
class TransformerShape:
    """What the FLOP count needs from a model config. ``decoder_layers`` > 0 marks an encoder-decoder (then
    ``layers`` counts the encoder)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated_mlp: bool
    decoder_layers: int = 0

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def is_encoder_decoder(self) -> bool:
        return self.decoder_layers > 0

    def mlp_weights(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    def self_attention_weights(self) -> int:
        q_and_out = 2 * self.hidden * self.attention_width
        return q_and_out + 2 * self.hidden * self.kv_heads * self.head_dim


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def shape_from_config(config: Any) -> TransformerShape:
    """A :class:`TransformerShape` from a transformers config or a dict with the same keys."""
    if _get(config, "d_model") is not None:  # T5 family
        heads = _get(config, "num_heads")
        projection = str(_get(config, "feed_forward_proj", default="relu"))
        return TransformerShape(
            layers=_get(config, "num_layers"),
            hidden=_get(config, "d_model"),
            ffn=_get(config, "d_ff"),
            heads=heads,
            kv_heads=heads,
            head_dim=_get(config, "d_kv", default=_get(config, "d_model") // heads),
            vocab=_get(config, "vocab_size"),
            gated_mlp=projection.startswith("gated"),
            decoder_layers=_get(config, "num_decoder_layers", "num_layers"),
        )
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    missing = [n for n, v in (("hidden_size", hidden), ("num_attention_heads", heads)) if v is None]
    if missing or _get(config, "num_hidden_layers") is None:
        raise ValueError(
            f"Cannot count FLOPs from this config: it lacks {missing or ['num_hidden_layers']}. Pass a transformers "
            "config (or dict) with num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, "
            "vocab_size (d_model, d_ff, num_layers for T5), or give flops_per_token instead."
        )
    family = str(_get(config, "model_type", default=""))
    return TransformerShape(
        layers=_get(config, "num_hidden_layers"),
        hidden=hidden,
        ffn=_get(config, "intermediate_size", "ffn_hidden_size", default=4 * hidden),
        heads=heads,
        kv_heads=_kv_heads(config, heads),
        head_dim=_get(config, "head_dim", default=hidden // heads),
        vocab=_get(config, "vocab_size"),
        gated_mlp=family not in _PLAIN_MLP_FAMILIES,
    )


def _kv_heads(config: Any, heads: int) -> int:
    if _get(config, "model_type") == "falcon" and not _get(config, "new_decoder_architecture", default=False):
        return 1 if _get(config, "multi_query", default=True) else heads  # Falcon-7B style multi-query
    return _get(config, "num_key_value_heads", "num_kv_heads", default=heads)


def forward_flops(shape: TransformerShape, batch: int, seq_len: int, target_len: Optional[int] = None) -> float:
    """Forward FLOPs of one batch: ``seq_len`` input positions (the encoder's, for an encoder-decoder) and
    ``target_len`` decoder positions (encoder-decoder only)."""
    s, width = seq_len, shape.attention_width
    head = 2 * shape.hidden * shape.vocab
    if not shape.is_encoder_decoder:
        per_layer = 2 * (shape.self_attention_weights() + shape.mlp_weights()) + 4 * s * width
        return batch * s * (shape.layers * per_layer + head)
    if target_len is None:
        raise ValueError("An encoder-decoder needs target_len (the decoder's positions) to count its FLOPs.")
    t = target_len
    encoder = s * shape.layers * (2 * (shape.self_attention_weights() + shape.mlp_weights()) + 4 * s * width)
    cross_query_out = 2 * shape.hidden * width
    decoder_per_layer = (
        2 * (shape.self_attention_weights() + cross_query_out + shape.mlp_weights()) + 4 * (t + s) * width
    )
    cross_keys_values = s * 2 * (2 * shape.hidden * width)  # computed once per decoder layer from encoder outputs
    decoder = shape.decoder_layers * (t * decoder_per_layer + cross_keys_values) + t * head
    return batch * (encoder + decoder)


def training_flops(shape: TransformerShape, batch: int, seq_len: int, target_len: Optional[int] = None) -> float:
    """Forward plus backward FLOPs of one batch (backward = 2 x forward)."""
    return 3 * forward_flops(shape, batch, seq_len, target_len)


def training_flops_per_token(shape: TransformerShape, seq_len: int) -> float:
    """Decoder-only: training FLOPs per position at sequence length ``seq_len`` (~ 6N + 12 L s d_attn)."""
    return training_flops(shape, 1, seq_len) / seq_len
