"""``DeferredEngine``: what ``fabric.setup(model)`` returns before the optimizer is known.

DeepSpeed builds its engine from the model and the optimizer together, while FSDP-style loops (LitGPT among them) set
up the model first, create the optimizer from the set-up model's parameters, and set that up second
(``fabric.setup_optimizers``). Fabric wraps whatever the strategy's ``setup_module`` returns in a ``_FabricModule``
and keeps it, so the object returned first has to stay valid once the engine exists. This module is that object: it
holds the bare model until the engine is built, then holds the engine and hands every call to it.

The strategy builds the engine with the optimizer at ``setup_optimizers``, or without one (for inference, as
Lightning's ``setup_module`` always did) at the first forward, save or load that needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch


class DeferredEngine(torch.nn.Module):
    """The model until the DeepSpeed engine is built, the engine afterwards.

    Args:
        module: the model as Fabric passed it to ``setup_module``.
        build_without_optimizer: builds the engine for inference; called on the first use that needs an engine when
            no optimizer was set up before.
    """

    def __init__(self, module: torch.nn.Module, build_without_optimizer: Callable[[torch.nn.Module], Any]) -> None:
        super().__init__()
        self.module = module
        self.engine: Optional[torch.nn.Module] = None  # a registered child once set: Fabric finds engines by modules()
        self._build_without_optimizer = build_without_optimizer

    @property
    def built(self) -> bool:
        return self.engine is not None

    def attach(self, engine: torch.nn.Module) -> None:
        if self.engine is not None:
            raise RuntimeError("DeferredEngine already holds an engine; DeepSpeed builds one per model.")
        self.engine = engine

    def built_engine(self) -> torch.nn.Module:
        """The engine, built for inference first if no optimizer was set up before this use."""
        if self.engine is None:
            self.attach(self._build_without_optimizer(self.module))
        return self.engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.built_engine()(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        # Fabric's DeepSpeed precision calls `model.backward(loss)` on what it takes for the engine
        return self.built_engine().backward(*args, **kwargs)
