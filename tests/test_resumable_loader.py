"""Where a resumed epoch starts, on one process: by index for a map-style loader (no skipped example read), modulo the
loader's length when Lightning cycled a shorter loader, by reading again for a stream."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_hpz.exact_resume.resumable_loader import ResumableLoader


class CountingReads(Dataset):
    def __init__(self, size: int) -> None:
        self.size, self.reads = size, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads += 1
        return torch.tensor(index)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10))


def _resumed(loader, consumed: int) -> list:
    resumable = ResumableLoader(loader, batches_consumed=lambda: 0)
    resumable.load_state_dict({"batches_consumed": consumed})
    return [batch.tolist() for batch in resumable]


def test_a_map_style_loader_starts_at_the_batch_without_reading_the_skipped_ones():
    data = CountingReads(24)
    loader = DataLoader(data, batch_size=4, sampler=torch.utils.data.SequentialSampler(data))
    everything = [batch.tolist() for batch in loader]
    data.reads = 0
    assert _resumed(loader, 4) == everything[4:]
    assert data.reads == 2 * 4  # only the two batches trained after the resume


def test_a_cycled_shorter_loader_resumes_within_its_round():
    loader = DataLoader(CountingReads(12), batch_size=4)  # 3 batches; the epoch had 8 of the longer loader
    assert _resumed(loader, 5) == [[8, 9, 10, 11]]  # 5 % 3 = 2 batches into the round
    assert _resumed(loader, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # its round ended: from the start


def test_a_stream_is_read_again_up_to_the_position_with_a_warning():
    with pytest.warns(UserWarning, match="its first 2 batches of this epoch are read again"):
        batches = _resumed(DataLoader(Stream(), batch_size=3), 2)
    assert batches == [[6, 7, 8], [9]]


def test_a_resume_on_fewer_ranks_starts_at_the_same_global_sample_position():
    loader = DataLoader(CountingReads(64), batch_size=2)  # this rank's 32 batches of an epoch on 2 ranks
    resumable = ResumableLoader(loader, batches_consumed=lambda: 3, world_size=2)
    assert resumable.state_dict()["world_size"] == 2
    resumable.load_state_dict({"batches_consumed": 3, "world_size": 4})  # 3 batches on each of 4 ranks: 12 in all
    assert next(iter(resumable)).tolist() == [12, 13]  # 6 batches per rank here: the next one is the 7th


def test_a_resume_whose_position_falls_between_batches_says_what_is_trained_again():
    resumable = ResumableLoader(DataLoader(CountingReads(60), batch_size=2), lambda: 0, world_size=3)
    with pytest.warns(UserWarning, match="continues after 1 batches per rank, so 1 rank-batches"):
        resumable.load_state_dict({"batches_consumed": 2, "world_size": 2})
