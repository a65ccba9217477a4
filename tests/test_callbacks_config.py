"""Both callbacks are configurable from LightningCLI YAML (class_path / init_args under `trainer.callbacks`)."""

import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch import Callback

from lightning_hpz.callbacks import LossStabilityMonitor, TokenThroughputMonitor

YAML = """
callbacks:
  - class_path: lightning_hpz.callbacks.LossStabilityMonitor
    init_args:
      action: rollback
      z_threshold: 5.0
      checkpoint_every_n_steps: 200
  - class_path: lightning_hpz.callbacks.TokenThroughputMonitor
    init_args:
      window_size: 10
      peak_flops: 9.894e14
      model_config: {model_type: llama, num_hidden_layers: 2, hidden_size: 64, intermediate_size: 176,
                     num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 384}
"""


def test_callbacks_from_yaml():
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    callbacks = parser.instantiate_classes(parser.parse_string(YAML)).callbacks
    stability, throughput = callbacks
    assert isinstance(stability, LossStabilityMonitor) and stability.action == "rollback"
    assert stability.thresholds.z_threshold == 5.0
    assert isinstance(throughput, TokenThroughputMonitor) and throughput.peak_flops == 9.894e14
    assert throughput.model_config["num_key_value_heads"] == 2


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="action"):
        LossStabilityMonitor(action="panic")
    with pytest.raises(ValueError, match="window_size"):
        TokenThroughputMonitor(window_size=1)
    with pytest.raises(ValueError, match="either"):
        TokenThroughputMonitor(model_config={"hidden_size": 8}, flops_per_token=1.0)
