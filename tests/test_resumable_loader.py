"""Where a resumed epoch starts, on one process: by index for a map-style loader (no skipped example read), modulo the
loader's length when Lightning cycled a shorter loader, at its saved position for a Stateful stream (each rank its
own), by reading again for any other stream, which ``exact_resume`` refuses."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_hpz.exact_resume.data_order import (
    DataOrderError,
    problems_known_at_start,
    refuse_set_up_that_cannot_resume,
)
from lightning_hpz.exact_resume.resumable_loader import ResumableLoader
from lightning_hpz.exact_resume.stream_position import keep_rank_positions


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


class PositionedStream(IterableDataset):
    """A Stateful stream: ``state_dict`` is the position after the examples yielded, ``load_state_dict`` the start of
    the next pass."""

    def __init__(self, size: int = 10) -> None:
        self.size, self.position, self._start, self.reads = size, 0, 0, 0

    def __iter__(self):
        start, self._start = self._start, 0
        for index in range(start, self.size):
            self.position, self.reads = index + 1, self.reads + 1
            yield torch.tensor(index)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self._start = state["position"]


def _trained(resumable: ResumableLoader, batches: int) -> list:
    """Train ``batches`` batches as Lightning does for a loader without a length: one batch fetched ahead."""
    iterator = iter(resumable)
    fetched = [next(iterator).tolist()]
    trained = []
    for _ in range(batches):
        trained.append(fetched.pop(0))
        fetched.append(next(iterator).tolist())
    return trained


def test_a_stateful_stream_resumes_at_its_position_after_the_last_trained_batch_not_the_prefetched_one():
    consumed = [0]
    interrupted = ResumableLoader(DataLoader(PositionedStream(), batch_size=3), lambda: consumed[0], exact=True)
    assert _trained(interrupted, 2) == [[0, 1, 2], [3, 4, 5]]  # and [6, 7, 8] fetched ahead, untrained
    consumed[0] = 2
    state = interrupted.state_dict()
    assert state["position"] == {"position": 6}

    stream = PositionedStream()
    resumed = ResumableLoader(DataLoader(stream, batch_size=3), lambda: 0, exact=True)
    resumed.load_state_dict(state)  # under exact_resume: no refusal, the stream can be positioned
    assert [batch.tolist() for batch in resumed] == [[6, 7, 8], [9]]
    assert stream.reads == 4  # nothing read again


def test_each_rank_keeps_its_own_position_and_rank_zero_every_ranks():
    positions = [{"position": 6}, {"position": 7}]  # after 2 batches of 3 on each rank, reading unequal streams
    states = [{"batches_consumed": 2, "world_size": 2, "position": position} for position in positions]
    checkpoints = [{"loops": {"fit_loop": {"state_dict": {"combined_loader": [state]}}}} for state in states]
    for rank, checkpoint in enumerate(checkpoints):  # what gather_object returns: every rank's on rank 0 alone
        keep_rank_positions(checkpoint, rank, lambda own, rank=rank: [[p] for p in positions] if rank == 0 else None)
    saved = [checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0] for checkpoint in checkpoints]
    assert saved[0]["positions"] == positions and "positions" not in saved[1]  # one copy of the N, not N copies
    # ZeRO 3: each rank reads its own file; ZeRO 1-2: every rank reads rank 0's
    for rank, state in [(0, saved[0]), (1, saved[1]), (1, saved[0])]:
        resumed = ResumableLoader(DataLoader(PositionedStream(), batch_size=3), lambda: 0, world_size=2, rank=rank)
        resumed.load_state_dict(state)
        assert next(iter(resumed)).tolist() == [6 + rank, 7 + rank, 8 + rank]
    # another rank's own position, or one saved on another number of ranks, is not taken for this rank's
    for rank, world_size in [(0, 2), (1, 4)]:
        resumed = ResumableLoader(
            DataLoader(PositionedStream(), batch_size=3), lambda: 0, world_size=world_size, rank=rank, exact=True
        )
        with pytest.raises(DataOrderError, match="holds no position of the training stream"):
            resumed.load_state_dict(saved[1])


def test_a_stateful_loader_is_positioned_by_itself_and_not_skipped_again():
    class PositionedLoader:  # a loader that positions itself, as torchdata's StatefulDataLoader does
        def __init__(self) -> None:
            self.stream = PositionedStream()

        def __iter__(self):
            return iter(DataLoader(self.stream, batch_size=3))

        def state_dict(self) -> dict:
            return {"loader": self.stream.state_dict()}

        def load_state_dict(self, state: dict) -> None:
            self.stream.load_state_dict(state["loader"])

    consumed = [0]
    interrupted = ResumableLoader(PositionedLoader(), lambda: consumed[0])
    _trained(interrupted, 1)
    consumed[0] = 1
    resumed = ResumableLoader(PositionedLoader(), lambda: 0)
    resumed.load_state_dict(interrupted.state_dict())
    assert [batch.tolist() for batch in resumed] == [[3, 4, 5], [6, 7, 8], [9]]


def test_an_epoch_end_position_starts_the_next_pass_at_the_beginning():
    resumed = ResumableLoader(DataLoader(PositionedStream(), batch_size=3), lambda: 0, exact=True)
    resumed.load_state_dict({"batches_consumed": 0, "position": {"position": 10}})
    assert next(iter(resumed)).tolist() == [0, 1, 2]


def test_exact_resume_refuses_a_stream_that_cannot_be_positioned_and_names_the_fixes():
    resumable = ResumableLoader(DataLoader(Stream(), batch_size=3), lambda: 0, exact=True)
    with pytest.raises(DataOrderError, match=r"(?s)Stream cannot be positioned.*load_state_dict.*exact_resume=False"):
        resumable.load_state_dict({"batches_consumed": 2})
    resumable.load_state_dict({"batches_consumed": 0})  # an epoch's start needs no position


def test_a_stateful_stream_read_by_workers_is_refused_naming_the_stateful_loader():
    resumable = ResumableLoader(DataLoader(PositionedStream(), batch_size=3, num_workers=2), lambda: 0, exact=True)
    with pytest.raises(DataOrderError, match=r"read by 2 worker processes.*StatefulDataLoader"):
        resumable.load_state_dict({"batches_consumed": 1})


def test_a_stateful_stream_without_a_saved_position_is_refused_naming_why():
    resumable = ResumableLoader(DataLoader(PositionedStream(), batch_size=3), lambda: 0, exact=True)
    with pytest.raises(DataOrderError, match="holds no position of the training stream"):
        resumable.load_state_dict({"batches_consumed": 1})  # a checkpoint from before positions were saved


def test_data_no_resume_could_continue_is_known_before_training():
    # what the strategy refuses when fit starts under exact_resume, instead of at the resume after a preemption
    unpositioned = DataLoader(Stream(), batch_size=3)
    with_workers = DataLoader(PositionedStream(), batch_size=3, num_workers=2)
    shuffled = DataLoader(CountingReads(6), shuffle=True)  # a RandomSampler: use_distributed_sampler=False
    (stream_problem,) = problems_known_at_start(unpositioned)
    assert "Stream cannot be positioned" in stream_problem
    assert "read by 2 worker processes" in problems_known_at_start(with_workers)[0]
    assert "RandomSampler" in problems_known_at_start(shuffled)[0]
    for resumable in (DataLoader(PositionedStream(), batch_size=3), DataLoader(CountingReads(6), batch_size=2)):
        assert problems_known_at_start(resumable) == []
    with pytest.raises(DataOrderError, match=r"(?s)refused before it trains: .*state_dict\(\).*exact_resume=False"):
        refuse_set_up_that_cannot_resume([stream_problem])
    refuse_set_up_that_cannot_resume([])
