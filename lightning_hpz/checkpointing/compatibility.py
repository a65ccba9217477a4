"""What a run is (stage, world, model, optimizer) and which differences from a checkpoint it cannot continue from."""

from __future__ import annotations

from typing import Any, Optional

_SHAPES_SHOWN = 3


def describe_run(
    strategy: Any, module: Any, engine: Any, global_step: Optional[int] = None, epoch: Optional[int] = None
) -> dict[str, Any]:
    """The facts a checkpoint records about the run that wrote it, and a resume compares against.

    ``module`` is the model whose parameters are recorded by name (the Trainer's LightningModule, the model a Fabric
    loop set up) and ``engine`` the DeepSpeed engine that saves or loads it (Fabric may hold several).
    """
    optimizer = getattr(engine, "basic_optimizer", None)  # the user's optimizer, inside DeepSpeed's ZeRO wrapper
    decision = getattr(strategy, "autotune_decision", None)
    return {
        "autotune": decision.to_dict() if decision is not None else None,  # re-used by a resume (autotune/tuner.py)
        "stage": int((strategy.config.get("zero_optimization") or {}).get("stage", 0)),  # 0: ZeRO off
        "world_size": int(strategy.world_size),
        "hpz_partition_size": int(getattr(strategy, "hpz_partition_size", None) or 1),
        "global_step": global_step,
        "epoch": epoch,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "param_groups": group_settings(optimizer),
        "parameters": {name: list(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()},
    }


def group_settings(optimizer: Any) -> Optional[list[dict[str, Any]]]:
    """Each parameter group's settings (learning rate, weight decay, betas, ...), without its parameters."""
    if optimizer is None:
        return None
    return [
        {key: list(value) if isinstance(value, tuple) else value for key, value in group.items() if _plain(key, value)}
        for group in optimizer.param_groups
    ]


def _plain(key: str, value: Any) -> bool:
    scalars = (bool, int, float, str, type(None))
    return key != "params" and (
        isinstance(value, scalars) or (isinstance(value, tuple) and all(isinstance(item, scalars) for item in value))
    )


def mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One sentence per difference the run cannot resume across, naming both sides. hpZ size and world size are fine:
    hpZ only changes communication, and a world-size change is converted (see universal.py)."""
    problems = []
    if saved.get("stage") is not None and saved["stage"] != current["stage"]:
        problems.append(
            f"ZeRO stage: the checkpoint was written with stage {saved['stage']}, this run uses stage "
            f"{current['stage']}. Resume with stage={saved['stage']}."
        )
    if saved.get("optimizer") and current.get("optimizer") and saved["optimizer"] != current["optimizer"]:
        problems.append(
            f"optimizer: the checkpoint holds {saved['optimizer']} state, this run's optimizer is "
            f"{current['optimizer']}. Use {saved['optimizer']} in configure_optimizers to resume."
        )
    shape_problem = _parameter_mismatch(saved.get("parameters"), current.get("parameters"))
    if shape_problem:
        problems.append(shape_problem)
    return problems


def _parameter_mismatch(saved: Optional[dict], current: Optional[dict]) -> str:
    if saved is None or current is None:
        return ""
    missing = [n for n in current if n not in saved]
    extra = [n for n in saved if n not in current]
    reshaped = [f"{n} {saved[n]} -> {current[n]}" for n in current if n in saved and saved[n] != current[n]]
    if not (missing or extra or reshaped):
        return ""
    details = []
    for label, names in (
        ("changed shape", reshaped),
        ("not in the checkpoint", missing),
        ("only in the checkpoint", extra),
    ):
        if names:
            shown = ", ".join(names[:_SHAPES_SHOWN]) + (
                f" (+{len(names) - _SHAPES_SHOWN} more)" if len(names) > _SHAPES_SHOWN else ""
            )
            details.append(f"{label}: {shown}")
    return (
        "model shape: the checkpoint's parameters differ from this run's model ("
        + "; ".join(details)
        + "). Build the model with the configuration it was trained with."
    )
