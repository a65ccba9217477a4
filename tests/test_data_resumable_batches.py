"""The per-epoch order costs O(1) memory, and a loader resumed at any batch continues exactly, reading nothing twice."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from torch.utils.data import Dataset

from lightning_hpz.data import ResumableBatches
from lightning_hpz.exact_resume.epoch_permutation import EpochPermutation
from lightning_hpz.exact_resume.resumable_batches import RankShare


@pytest.mark.parametrize("size", [1, 2, 7, 64, 1000, 4099])
def test_epoch_order_is_a_permutation(size):
    order = EpochPermutation(size, seed=3, epoch=1).order(np.arange(size))
    assert sorted(order.tolist()) == list(range(size))


def test_each_epoch_and_seed_has_its_own_reproducible_order():
    orders = {(s, e): EpochPermutation(500, s, e).order(np.arange(500)).tolist() for s in (0, 1) for e in (0, 1)}
    assert len({tuple(order) for order in orders.values()}) == 4
    assert EpochPermutation(500, 1, 1).order(np.arange(500)).tolist() == orders[(1, 1)]
    assert EpochPermutation(500, 0, 0, shuffle=False).order(np.arange(500)).tolist() == list(range(500))


def test_any_position_of_a_huge_epoch_is_computed_directly():
    positions = np.array([0, 10**9, 16 * 10**9 - 1])
    order = EpochPermutation(16 * 10**9, seed=0, epoch=0).order(positions)
    assert order.min() >= 0 and order.max() < 16 * 10**9 and len(set(order.tolist())) == 3


class CountingDataset(Dataset):
    def __init__(self, size: int) -> None:
        self.size, self.reads = size, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        self.reads += 1
        return {"sample_index": index, "x": torch.tensor([index])}


def _loader(rank: int = 0, world: int = 2, size: int = 103) -> ResumableBatches:
    return ResumableBatches(CountingDataset(size), RankShare(size, rank, world, seed=5, shuffle=True), batch_size=4)


def test_ranks_share_an_epoch_without_overlap_like_distributed_sampler_with_drop_last():
    per_rank = [[i for b in _loader(rank, world=3) for i in b["sample_index"].tolist()] for rank in range(3)]
    seen = [i for indices in per_rank for i in indices]
    assert len(seen) == len(set(seen)) == 3 * (103 // 3 // 4) * 4


@pytest.mark.parametrize("consumed", [1, 6, 11])
def test_resume_mid_epoch_continues_exactly_without_reading_skipped_batches(consumed):
    uninterrupted = _loader()
    uninterrupted.sampler.set_epoch(2)
    expected = [b["sample_index"].tolist() for b in uninterrupted]
    interrupted = _loader()
    interrupted.sampler.set_epoch(2)
    iterator = iter(interrupted)
    for _ in range(consumed):
        next(iterator)
    state = interrupted.state_dict()
    assert isinstance(interrupted, _Stateful) and state == {"epoch": 2, "batches_consumed": consumed}
    resumed = _loader()
    resumed.load_state_dict(state)
    assert [b["sample_index"].tolist() for b in resumed] == expected[consumed:]
    assert resumed.dataset.reads == (len(expected) - consumed) * 4
    assert len([b for b in resumed]) == len(expected)  # the next epoch starts from its beginning


def test_a_checkpoint_at_the_epoch_end_resumes_at_the_next_epoch_start():
    loader = _loader()
    loader.load_state_dict({"epoch": 0, "batches_consumed": len(loader)})
    assert len(list(loader)) == len(loader)


def test_datamodule_loader_is_stateful_so_the_strategy_does_not_wrap_it(tmp_path):
    from lightning_hpz.data import CausalLMDataModule

    datamodule = CausalLMDataModule(sequence_length=64, batch_size=2, cache_dir=str(tmp_path))
    datamodule.trainer = SimpleNamespace(world_size=2, global_rank=1)
    datamodule.setup("fit")
    assert isinstance(datamodule.train_dataloader(), _Stateful)
