"""Examples are sharded across ranks without overlap, shuffled per epoch, reproducibly."""

from types import SimpleNamespace

import pytest

from lightning_hpz.data import CausalLMDataModule

WORLD = 4


@pytest.fixture(scope="module")
def datamodule(tmp_path_factory):
    module = CausalLMDataModule(sequence_length=256, batch_size=4, cache_dir=str(tmp_path_factory.mktemp("cache")))
    module.prepare_data()
    module.setup("fit")
    return module


def _epoch_indices(datamodule, rank: int, epoch: int, split: str = "train") -> list[int]:
    datamodule.trainer = SimpleNamespace(world_size=WORLD, global_rank=rank)
    loader = datamodule.train_dataloader() if split == "train" else datamodule.val_dataloader()
    loader.sampler.set_epoch(epoch)  # what Lightning calls at each epoch start
    return [i for batch in loader for i in batch["sample_index"].tolist()]


@pytest.mark.parametrize("split", ["train", "val"])
def test_no_example_is_seen_twice_across_ranks_in_an_epoch(datamodule, split):
    per_rank = [_epoch_indices(datamodule, rank, epoch=0, split=split) for rank in range(WORLD)]
    everything = [i for indices in per_rank for i in indices]
    assert len(everything) == len(set(everything))
    assert len({len(indices) for indices in per_rank}) == 1  # every rank takes the same number of steps
    dataset = datamodule.train_set if split == "train" else datamodule.val_set
    assert len(everything) > len(dataset) - WORLD * datamodule.batch_size  # only a last partial round is left out


def test_each_epoch_has_its_own_reproducible_order(datamodule):
    epoch0, epoch1 = _epoch_indices(datamodule, 0, 0), _epoch_indices(datamodule, 0, 1)
    assert epoch0 != epoch1
    assert _epoch_indices(datamodule, 0, 1) == epoch1


def test_validation_examples_are_not_trained_on(datamodule):
    train_rows = {tuple(example["input_ids"].tolist()) for example in datamodule.train_set}
    val_rows = [tuple(example["input_ids"].tolist()) for example in datamodule.val_set]
    assert val_rows and not train_rows.intersection(val_rows)
