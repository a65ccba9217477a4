"""The state of DeepSpeed's dynamic fp16 loss scaler, kept and put back around a step the package drops on purpose.

``LossStabilityMonitor`` drops an update by making its gradients NaN, so that DeepSpeed's own overflow guard discards
it on every rank. Under fp16 that guard also tells the dynamic loss scaler an overflow happened: it lowers its
hysteresis or halves the scale and restarts its count of clean steps, for an overflow that never was (and again at
each replay of a skip-listed batch after a resume). Putting the scaler's state back as it was before the step makes
the dropped step invisible to it. Genuine overflows, on steps the monitor did not drop, are left alone.
"""

from __future__ import annotations

from typing import Any, Optional

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from lightning_hpz.partitioning.deepspeed_patch import IncompatibleDeepSpeedError

# what DynamicLossScaler.update_scale reads and writes (DeepSpeed 0.16 to 0.19)
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def dynamic_loss_scaler(engine: Any) -> Optional[DynamicLossScaler]:
    """The engine's dynamic loss scaler (fp16 with ``loss_scale: 0``), or None (bf16, fp32, a static scale)."""
    scaler = getattr(getattr(engine, "optimizer", None), "loss_scaler", None)
    return scaler if isinstance(scaler, DynamicLossScaler) else None


def snapshot_loss_scale(engine: Any) -> Optional[dict[str, Any]]:
    """The dynamic scaler's state now (plain Python values: nothing waits for the device), or None."""
    scaler = dynamic_loss_scaler(engine)
    if scaler is None:
        return None
    missing = [name for name in SCALER_FIELDS if not hasattr(scaler, name)]
    if missing:
        raise IncompatibleDeepSpeedError(
            f"DeepSpeed's DynamicLossScaler has no {missing}: lightning_hpz cannot keep the fp16 loss scale unchanged "
            "when LossStabilityMonitor drops an update. Install a tested DeepSpeed release or use bf16."
        )
    return {name: getattr(scaler, name) for name in SCALER_FIELDS}


def restore_loss_scale(engine: Any, snapshot: Optional[dict[str, Any]]) -> None:
    """Put back a state from :func:`snapshot_loss_scale` (into the scaler the engine holds now)."""
    scaler = dynamic_loss_scaler(engine)
    if scaler is None or snapshot is None:
        return
    for name, value in snapshot.items():
        setattr(scaler, name, value)
