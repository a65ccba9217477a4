"""Initial weights that depend on the seed and on each module's qualified name only, not on the parallelism.

Why this exists: under ZeRO-1/2 a transformers model draws its weights in ``post_init`` while it is built; under
ZeRO-3 (``zero.Init``) every layer is partitioned as soon as it exists, ``post_init`` finds empty tensors and draws
nothing, and the weights have to be drawn again afterwards with the layers gathered: the same numbers in another
order, so the same seed gave another model (the quickstart's first loss: 5.926 under ZeRO-1, 5.972 under ZeRO-3).
Here each module is initialised from a generator seeded with (seed, its qualified name), so no draw depends on when,
in which order, on how many ranks or how partitioned the module is initialised.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from lightning_hpz.models.sharded_weights import gathered, init_targets

ModuleInit = Callable[[nn.Module], None]


def draw_seed() -> int:
    """A seed drawn from torch's default (CPU) generator: the same on every rank and under every ZeRO stage at the
    start of ``configure_model`` (Lightning seeds every rank alike), so it is drawn before anything is built.

    The device is named: under ZeRO-1/2 on a GPU, ``configure_model`` runs inside ``torch.device("cuda")`` (Lightning's
    init context), where a plain ``torch.randint`` draws from the CUDA generator; under ZeRO-3 (``zero.Init``, no
    device context) from the CPU one, so the two stages got different seeds (seen on an H200, not on a CPU)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu").item())


def name_seed(seed: int, name: str) -> int:
    """The seed of the module called ``name``: a stable hash (Python's ``hash`` differs between processes)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Draw from ``seed`` inside the block (on the CPU and on ``device``), leaving the caller's generators as found."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def post_order_with_owners(
    module: nn.Module, name: str = "", owner: Optional[nn.Module] = None, seen: Optional[set[int]] = None
) -> Iterator[tuple[str, nn.Module, Optional[nn.Module]]]:
    """Every submodule after its children (as ``nn.Module.apply`` and transformers' ``post_init`` visit them), with
    its qualified name and the nearest module at or above it that has an ``_init_weights`` (a transformers model).

    A module found under several names (T5's embedding is ``shared`` and each stack's ``embed_tokens``) comes once,
    under the first: drawing it again would only cost time (and, under ZeRO-3, another gather of a vocabulary).
    """
    seen = set() if seen is None else seen
    seen.add(id(module))
    owner = module if callable(getattr(module, "_init_weights", None)) else owner
    for child_name, child in module.named_children():
        if id(child) not in seen:
            yield from post_order_with_owners(child, f"{name}.{child_name}" if name else child_name, owner, seen)
    yield name, module, owner


def _default_init(module: nn.Module, owner: Optional[nn.Module]) -> None:
    """What the module's own code would do: its model's ``_init_weights``, else the layer's ``reset_parameters``."""
    if owner is not None:
        owner._init_weights(module)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def initialize_by_name(module: nn.Module, init_fn: Optional[ModuleInit] = None, seed: Optional[int] = None) -> None:
    """Initialise ``module`` so that its weights depend on ``seed`` and the parameter names only.

    Every submodule, children before parents, is initialised with its parameters gathered (under ZeRO-3) and torch's
    generators seeded from (``seed``, its qualified name in ``module``). Call it on every rank, in ``configure_model``.

    Args:
        module: the model; parameters may be ZeRO-3 partitioned or whole.
        init_fn: called with each submodule, as ``module.apply(init_fn)`` would be. Default: the ``_init_weights`` of
            the nearest transformers model (or any module defining one) above it, else its ``reset_parameters()``.
        seed: default: one number drawn from torch's default generator.
    """
    seed = draw_seed() if seed is None else seed
    for name, submodule, owner in post_order_with_owners(module):
        targets = init_targets(submodule)
        if not targets:
            continue  # nothing of its own to draw (buffers such as rotary frequencies are computed, not drawn)
        with gathered(targets, modifier_rank=0), torch.no_grad(), _seeded(name_seed(seed, name), targets[0].device):
            if init_fn is None:
                _default_init(submodule, owner)
            else:
                init_fn(submodule)
