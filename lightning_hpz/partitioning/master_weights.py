"""The optimizer's own copy of the weights, brought back in line after the weights were written from outside.

Every ZeRO optimizer steps a copy of its partition of the weights (fp32 "master" weights, a clone made when the
engine is built, also under fp32 training) and copies the result into the model's parameters. A load into the model
after the engine exists (``fabric.load_raw``, ``model.load_state_dict``: LitGPT loads its initial checkpoint or
fine-tuning weights that way) changes the parameters only: the next step starts from the stale copy and overwrites
the load (LitGPT's ``initial_checkpoint_dir``: the first loss matches DDP's, every later one drifts from it;
``tests/test_litgpt_loops.py``). DeepSpeed refreshes that copy itself only in its own module-only
checkpoint load (``refresh_fp32_params``, DeepSpeed 0.16 to 0.19).
"""

from __future__ import annotations

from typing import Any

REFRESH = "refresh_fp32_params"


def refresh_master_weights(engine: Any) -> bool:
    """Copy the parameters into the optimizer's master weights; whether the optimizer keeps any to refresh."""
    refresh = getattr(getattr(engine, "optimizer", None), REFRESH, None)
    if not callable(refresh):
        return False
    refresh()
    return True
