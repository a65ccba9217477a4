"""What importing lightning_hpz does to DeepSpeed, in a fresh process; prints one JSON line for the test.

First every ``deepspeed`` import fails, as on a machine without it: the package, its callbacks and models are imported
and used. Then DeepSpeed is let in: are its functions still its own after ``import lightning_hpz``?
"""

import importlib.abc
import json
import sys


class NoDeepSpeed(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "deepspeed" or fullname.startswith("deepspeed."):
            raise ImportError(f"No module named {fullname!r} (blocked by the test)")
        return None


def callbacks_and_models_without_deepspeed() -> dict:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_hpz
    import lightning_hpz.callbacks as callbacks
    import lightning_hpz.models as models

    monitors = [
        callbacks.TokenThroughputMonitor(),
        callbacks.LossStabilityMonitor(),
        callbacks.SecondaryPartitionCheck(),
    ]
    model = models.Llama2(preset="llama2-tiny")
    model.configure_model()  # builds the transformers model; knows nothing of hpZ
    return {
        "registered": sorted(name for name in ("hpz", "zero3", "zeropp") if name in StrategyRegistry),
        "strategy": lightning_hpz.HpzStrategy.__name__,
        "callbacks": len(monitors),
        "parameters": sum(p.numel() for p in model.parameters()),
        "deepspeed_modules": sorted(name for name in sys.modules if name.split(".")[0] == "deepspeed"),
    }


def deepspeed_functions_after_import() -> list[str]:
    """Modules of the functions lightning_hpz wraps while a strategy is set up (DeepSpeed's own, or this package's)."""
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.utils import groups

    functions = [
        partition_parameters.Init._partition_param_sec,
        partition_parameters.Init._convert_to_deepspeed_param,
        groups._create_zero_param_parallel_group,
    ]
    return sorted({function.__module__.split(".")[0] for function in functions})


if __name__ == "__main__":
    blocker = NoDeepSpeed()
    sys.meta_path.insert(0, blocker)
    record = callbacks_and_models_without_deepspeed()
    sys.meta_path.remove(blocker)
    record["wrapped_function_owners"] = deepspeed_functions_after_import()
    print(json.dumps(record))
