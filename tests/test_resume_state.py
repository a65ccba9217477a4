"""What a resume restores, without DeepSpeed: the loop state of an epoch-end checkpoint, and the data-order checks."""

import copy

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset, RandomIterableDataset
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lightning_hpz.exact_resume.data_order import DataOrderError, check_resumed_order, order_record, saved_order
from lightning_hpz.exact_resume.epoch_end_checkpoint import complete_epoch_saved_at_epoch_end
from lightning_hpz.exact_resume.random_layers import active_dropout_layers, warn_if_resume_draws_random_numbers


class LoopStates(L.Callback):
    """The fit loop's state where ModelCheckpoint would save it: at a mid-epoch batch end and at the epoch end."""

    def __init__(self) -> None:
        self.states: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.states["mid_epoch"] = {"loops": {"fit_loop": copy.deepcopy(trainer.fit_loop.state_dict())}}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.states.setdefault("epoch_end", {"loops": {"fit_loop": copy.deepcopy(trainer.fit_loop.state_dict())}})


@pytest.fixture(scope="module")
def loop_states():
    recorder = LoopStates()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        limit_train_batches=4,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    return recorder.states


def test_epoch_end_checkpoint_resumes_as_next_epoch_start(loop_states):
    checkpoint = copy.deepcopy(loop_states["epoch_end"])
    assert complete_epoch_saved_at_epoch_end(checkpoint)
    fit_loop = checkpoint["loops"]["fit_loop"]
    for counts in fit_loop["epoch_progress"].values():
        assert counts["completed"] == counts["processed"] == 1
    assert set(fit_loop["epoch_loop.batch_progress"]["current"].values()) == {0}
    assert fit_loop["epoch_loop.batch_progress"]["is_last_batch"] is False
    assert fit_loop["epoch_loop.batch_progress"]["total"]["completed"] == 4  # the run's totals are kept
    step = fit_loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
    assert step["total"]["completed"] == 4 and step["current"]["completed"] == 0


def test_mid_epoch_and_completed_checkpoints_are_left_alone(loop_states):
    for state in (loop_states["mid_epoch"], complete_epoch_copy(loop_states["epoch_end"])):
        checkpoint = copy.deepcopy(state)
        assert not complete_epoch_saved_at_epoch_end(checkpoint)
        assert checkpoint == state
    assert not complete_epoch_saved_at_epoch_end({"state_dict": {}})  # a weights-only checkpoint


def complete_epoch_copy(state: dict) -> dict:
    state = copy.deepcopy(state)
    complete_epoch_saved_at_epoch_end(state)
    return state


# ----------------------------------------------------------------------------------------------- data order
def distributed_loader(seed: int, shuffle: bool = True) -> DataLoader:
    dataset = RandomDataset(4, 16)
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 2, 0, shuffle=shuffle, seed=seed))


def test_same_seed_resumes_silently(recwarn):
    check_resumed_order(order_record(distributed_loader(seed=7)), distributed_loader(seed=7), exact=True)
    check_resumed_order({}, DataLoader(RandomDataset(4, 16)), exact=True)  # sequential: nothing to repeat
    assert not [w for w in recwarn if "resume" in str(w.message).lower()]


def test_other_sampler_seed_is_refused_naming_the_seed():
    with pytest.raises(DataOrderError, match=r"seed_everything\(7\)"):
        check_resumed_order(order_record(distributed_loader(seed=7)), distributed_loader(seed=8), exact=True)
    with pytest.warns(UserWarning, match="other batches"):
        check_resumed_order(order_record(distributed_loader(seed=7)), distributed_loader(seed=8), exact=False)
    # without shuffling the seed decides nothing
    check_resumed_order(order_record(distributed_loader(7, False)), distributed_loader(8, False), exact=True)


def test_random_sampler_is_refused():
    loader = DataLoader(RandomDataset(4, 16), shuffle=True)
    with pytest.raises(DataOrderError, match=r"RandomSampler.*use_distributed_sampler=True"):
        check_resumed_order({}, loader, exact=True)
    with pytest.warns(UserWarning, match="RandomSampler"):
        check_resumed_order({}, loader, exact=False)


class Reversed(Sampler):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(range(self.size - 1, -1, -1))


def test_custom_sampler_without_set_epoch_warns():
    with pytest.warns(UserWarning, match=r"Reversed.*cannot be checked"):
        check_resumed_order({}, DataLoader(RandomDataset(4, 16), sampler=Reversed(16)), exact=True)


def test_a_stream_has_no_sampler_order_to_check(recwarn):
    # its order is its own; whether it can be put back at its position is ResumableLoader's check
    check_resumed_order({}, DataLoader(RandomIterableDataset(4, 16)), exact=True)
    assert not [w for w in recwarn if "resume" in str(w.message).lower()]


def test_order_record_is_read_back_from_the_loop_state():
    record = order_record(distributed_loader(seed=3))
    assert record == {"sampler": "DistributedSampler", "seed": 3}
    loader_states = [{"batches_consumed": 2, "order": record}]
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": loader_states}}}}
    assert saved_order(checkpoint) == record
    assert saved_order({"loops": {"fit_loop": {"state_dict": {}}}}) == {}


def test_dropout_is_named_in_a_resume_warning(recwarn):
    from lightning.pytorch.demos import Transformer

    assert active_dropout_layers(Transformer(vocab_size=8, ninp=8, nhead=2, nhid=8, nlayers=1, dropout=0.0)) == []
    model = Transformer(vocab_size=8, ninp=8, nhead=2, nhid=8, nlayers=1, dropout=0.1)
    assert "pos_encoder.dropout" in active_dropout_layers(model)
    with pytest.warns(UserWarning, match=r"cannot continue exactly: \d+ dropout layer\(s\) \(pos_encoder.dropout"):
        warn_if_resume_draws_random_numbers(model)
