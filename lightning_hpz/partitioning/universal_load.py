"""Load a DeepSpeed universal checkpoint into an engine that was configured without ``load_universal``.

Whether a resume needs the universal format is known only at load time (the checkpoint's world size), after
``deepspeed.initialize`` has parsed the config. ``DeepSpeedEngine.load_universal_checkpoint()`` reads the flag from
the engine's parsed config (``engine._config.load_universal_checkpoint``, DeepSpeed 0.19.x) on every load; this sets
it for one load and restores it. Checked at import that the installed DeepSpeed still reads it from there.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from deepspeed.runtime.engine import DeepSpeedEngine

from lightning_hpz.partitioning.deepspeed_patch import IncompatibleDeepSpeedError

_FLAG = "load_universal_checkpoint"

if "_config.load_universal_checkpoint" not in inspect.getsource(DeepSpeedEngine.load_universal_checkpoint):
    raise IncompatibleDeepSpeedError(
        "The installed DeepSpeed no longer reads `load_universal_checkpoint` from the engine's parsed config; "
        "lightning_hpz cannot resume on a different number of ranks with it. Install deepspeed<0.20."
    )


@contextmanager
def universal_loading(engine: Any) -> Iterator[None]:
    """Within this block, ``engine.load_checkpoint`` reads the universal layout (``zero/<param>/fp32.pt`` ...)."""
    config = engine._config
    before = getattr(config, _FLAG)
    setattr(config, _FLAG, True)
    try:
        yield
    finally:
        setattr(config, _FLAG, before)
