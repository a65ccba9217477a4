"""DeepSpeed's copy synchronize is held off only on the thread that partitions, and never stays held off.

DeepSpeed's backward hooks can run on several threads. While one thread is inside the hold-off, every other thread must
still see DeepSpeed's own answer (False for a CUDA accelerator: synchronize after copies), and however the hold-offs of
several threads overlap, the answer afterwards is DeepSpeed's again.
"""

import random
import threading

import pytest
from deepspeed.runtime.zero import partition_parameters

from lightning_hpz.partitioning import deepspeed_patch


class AsyncAccelerator:
    """Answers like DeepSpeed's CUDA accelerator: copies do not resolve their data dependency by themselves."""

    def resolves_data_dependency(self) -> bool:
        return False


@pytest.fixture
def accelerator(monkeypatch):
    accelerator = AsyncAccelerator()
    monkeypatch.setattr(partition_parameters, "get_accelerator", lambda: accelerator)
    yield accelerator
    deepspeed_patch.uninstall()


def _hold_off_in_thread(entered: threading.Event, leave: threading.Event, seen: list) -> threading.Thread:
    def hold() -> None:
        with deepspeed_patch._deepspeed_copy_sync_held_off():
            seen.append(partition_parameters.get_accelerator().resolves_data_dependency())
            entered.set()
            assert leave.wait(timeout=10)

    thread = threading.Thread(target=hold)
    thread.start()
    return thread


def test_other_threads_never_see_the_hold_off(accelerator):
    entered, leave, seen = threading.Event(), threading.Event(), []
    thread = _hold_off_in_thread(entered, leave, seen)
    assert entered.wait(timeout=10)
    observed_elsewhere = accelerator.resolves_data_dependency()  # e.g. stage3's gradient bucket path, another thread
    leave.set()
    thread.join(timeout=10)
    assert seen == [True]
    assert observed_elsewhere is False


def test_overlapping_hold_offs_leaving_in_any_order_restore_deepspeeds_answer(accelerator):
    # first in, first out: a save/restore per call would restore the second call's "True" last, for good
    first, second = (threading.Event(), threading.Event()), (threading.Event(), threading.Event())
    seen: list = []
    threads = [_hold_off_in_thread(first[0], first[1], seen)]
    assert first[0].wait(timeout=10)
    threads.append(_hold_off_in_thread(second[0], second[1], seen))
    assert second[0].wait(timeout=10)
    first[1].set()
    threads[0].join(timeout=10)
    second[1].set()
    threads[1].join(timeout=10)
    assert seen == [True, True]
    assert accelerator.resolves_data_dependency() is False


def test_many_threads_hold_off_and_observe_at_random(accelerator):
    wrong, stop = [], threading.Event()

    def partition(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            with deepspeed_patch._deepspeed_copy_sync_held_off():
                if accelerator.resolves_data_dependency() is not True:
                    wrong.append("held-off thread saw DeepSpeed's answer")
                if rng.random() < 0.5:
                    with deepspeed_patch._deepspeed_copy_sync_held_off():  # nested: still held off afterwards
                        pass
                    if accelerator.resolves_data_dependency() is not True:
                        wrong.append("nested exit ended the outer hold-off")

    def observe() -> None:
        while not stop.is_set():
            if accelerator.resolves_data_dependency() is not False:
                wrong.append("an observing thread saw the hold-off")

    observers = [threading.Thread(target=observe) for _ in range(2)]
    partitioners = [threading.Thread(target=partition, args=(seed,)) for seed in range(6)]
    for thread in observers + partitioners:
        thread.start()
    for thread in partitioners:
        thread.join(timeout=60)
    stop.set()
    for thread in observers:
        thread.join(timeout=10)
    assert wrong == []
    assert accelerator.resolves_data_dependency() is False


def test_uninstall_gives_the_accelerator_its_own_method_back(accelerator):
    deepspeed_patch.install("event")
    with deepspeed_patch._deepspeed_copy_sync_held_off():
        assert "resolves_data_dependency" in vars(accelerator)  # the one gate, installed once
    deepspeed_patch.uninstall()
    assert "resolves_data_dependency" not in vars(accelerator)
