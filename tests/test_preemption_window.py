"""The preemption handler's window, in one process: Lightning's handler kept out from set-up to teardown, the
previous handlers back afterwards; a Fabric loop that never asks keeps the signal's old behaviour."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from lightning_hpz.lifecycle.polled_preemption import PolledPreemption
from lightning_hpz.lifecycle.preemption_checkpoint import PreemptionCheckpoint


def _trainer_with_a_signal_connector() -> SimpleNamespace:
    trainer = SimpleNamespace()
    trainer._signal_connector = _SignalConnector(trainer)
    return trainer


def test_window_keeps_lightnings_handler_out_until_closed():
    previous = signal.getsignal(signal.SIGTERM)
    trainer = _trainer_with_a_signal_connector()
    callback = PreemptionCheckpoint()
    callback.open_window(trainer)
    ours = signal.getsignal(signal.SIGTERM)
    trainer._signal_connector.register_signal_handlers()  # what Trainer._run calls after the checkpoint load
    assert signal.getsignal(signal.SIGTERM) == ours and signal.getsignal(signal.SIGUSR1) == ours
    os.kill(os.getpid(), signal.SIGTERM)
    assert callback.preemption.received == signal.SIGTERM  # recorded, nothing else: the process lives on
    callback.close_window()
    assert signal.getsignal(signal.SIGTERM) == previous
    assert "register_signal_handlers" not in vars(trainer._signal_connector), "Lightning's method is back"


def test_a_new_window_forgets_the_previous_runs_signal():
    callback = PreemptionCheckpoint(signals=("SIGUSR1",))
    callback.open_window(_trainer_with_a_signal_connector())
    os.kill(os.getpid(), signal.SIGUSR1)
    callback.close_window()
    callback.open_window(_trainer_with_a_signal_connector())
    assert callback.preemption.received is None
    callback.close_window()


def test_fabric_loop_that_never_asks_gets_the_old_behaviour_and_one_that_asks_is_told():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        polled = PolledPreemption(("SIGUSR1",))
        polled.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1], "not polled yet: the handler from before set-up ran"
        polled = PolledPreemption(("SIGUSR1",))
        polled.install()
        assert not polled.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert polled.requested() and seen == [signal.SIGUSR1]
        polled.uninstall()
    finally:
        signal.signal(signal.SIGUSR1, previous)
