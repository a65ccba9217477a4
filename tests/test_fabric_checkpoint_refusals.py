"""What ``HpzFabricStrategy`` leaves to Lightning around its committed saves and verified loads, without processes.

The calls Lightning refuses are refused with Lightning's own error before anything is written (no staging folder, no
writer lock), and a single file loaded into a module is Lightning's plain ``torch.load``, which never looks for a
manifest. The committed saves and verified loads themselves: tests/test_fabric_checkpoints.py.
"""

import pytest
import torch
from lightning.fabric.strategies import DeepSpeedStrategy
from torch import nn

from lightning_hpz import HpzFabricStrategy


def _lightnings_error(call) -> Exception:
    with pytest.raises((TypeError, ValueError)) as caught:
        call(DeepSpeedStrategy(stage=3))
    return caught.value


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s, p: s.save_checkpoint(p, {"model": nn.Linear(2, 2)}), id="no engine"),
        pytest.param(lambda s, p: s.save_checkpoint(p, {}, filter={"model": lambda k, v: True}), id="filter"),
        pytest.param(lambda s, p: s.save_checkpoint(p, {}, storage_options={}), id="storage_options"),
        pytest.param(lambda s, p: s.load_checkpoint(p, state={}), id="load without state"),
    ],
)
def test_refused_as_lightning_refuses_before_writing(tmp_path, call):
    path = tmp_path / "ckpt"
    expected = _lightnings_error(lambda strategy: call(strategy, path))
    with pytest.raises(type(expected)) as caught:
        call(HpzFabricStrategy(stage=3), path)
    assert str(caught.value) == str(expected)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no staging folder, no writer lock


def test_a_single_file_loads_into_a_module_as_in_lightning(tmp_path):
    torch.save(nn.Linear(3, 2).state_dict(), tmp_path / "weights.pt")
    into = nn.Linear(3, 2)
    assert HpzFabricStrategy(stage=3).load_checkpoint(tmp_path / "weights.pt", state=into) == {}
    assert torch.equal(into.weight, torch.load(tmp_path / "weights.pt")["weight"])
