"""Every Lightning internal lightning_hpz relies on, in one place, checked against the installed Lightning at import.

``partitioning/`` is this for DeepSpeed. Outside this module the package uses Lightning's public API only
(tests/test_lightning_seam.py scans for that). At import, the installed Lightning must be one of
``SUPPORTED_LIGHTNING`` and have every internal named here; otherwise :class:`IncompatibleLightningError` names the
release to install, instead of an override that Lightning silently stops calling.

Each use, the public route looked for first, and why it is not enough:

- **The DeepSpeed strategies' private hooks** (both ``DeepSpeedStrategy`` classes; :class:`TrainerDeepSpeedHooks`,
  :class:`FabricDeepSpeedHooks` hand each to a method of the package's own name): ``_configure_launcher`` (the only
  hook the connectors call while the Trainer or Fabric is built, before any process starts: the layout checks, and
  the Trainer's launcher), ``_init_deepspeed_distributed`` (the process group exists and DeepSpeed's groups do not
  yet), ``_set_deepspeed_activation_checkpointing`` (Lightning's leaves out two settings), ``_load_config``
  (Lightning replaces its defaults by the user's config; the package merges), the Trainer's
  ``_setup_model_and_optimizer`` and ``_initialize_deepspeed_inference`` (the engine is built with the package's
  config and device rank, which Lightning's take from CUDA), Fabric's ``_setup_distributed``, ``_set_world_ranks``,
  ``_format_config``/``_config_initialized`` (the CPU path: Lightning's checks CUDA device indices first),
  ``_initialize_engine``, ``_backward_sync_control`` and ``_deepspeed_engine`` (read by Fabric itself). Lightning
  2.5's Fabric sets up no scheduler (``_initialize_engine`` returns two values, ``setup_module_and_optimizers``
  takes two arguments); the adapter gives the package 2.6's form on both. Public
  ``setup_environment``/``setup`` run too late or too early for each; subclassing is Lightning's own way to extend
  a strategy, and these are the hooks it left private.
- **Launchers**: ``_SubprocessScriptLauncher`` is what DeepSpeed launches with; the strategy's ``launcher``
  property is public but read-only, and the launcher class is private. Extended (ops built before the other ranks
  start, the resume by name chosen once the ranks run) and its ``procs`` killed after a rank failure.
- **The Trainer's checkpoint connector** (``_CheckpointConnector`` as ``trainer._checkpoint_connector``): ``"last"``
  and ``"hpc"`` are resolved there, on each rank alone, before any strategy hook; the choice needs the process
  group (a repair by one rank, the same answer on all). ``Strategy.load_checkpoint`` is public but is never called
  when Lightning found no ``last.ckpt``. So the connector's class is a subclass while an entry point runs
  (:func:`checkpoint_connector_extended`).
- **``ModelCheckpoint.__resolve_ckpt_dir``** (name-mangled): the folder Lightning's own ``"last"`` lookup searches;
  ``dirpath`` is None until the callback's ``setup``, which runs after the resume is chosen.
- **``Trainer._run``'s ``ckpt_path``**: the resolved resume path, stored on the Trainer only after the engine is
  built (``trainer.ckpt_path``), and the autotuner needs it before (:func:`resolved_ckpt_path`).
- **``trainer._signal_connector.register_signal_handlers``**: installs Lightning's SIGTERM handler (a broadcast
  inside the handler) in ``Trainer._run``; ``SLURMEnvironment(auto_requeue=False)`` stops only the SIGUSR1 one.
- **``LightningModule._trainer``**: ``module.trainer`` raises when none is attached (:func:`attached_trainer`).
- **``fit_loop._should_accumulate()``**: whether the batch ends in an optimizer step, as Lightning's own
  ``ThroughputMonitor`` asks it; ``_plugin_to_compute_dtype`` is that monitor's dtype rule.
- **Fabric**: ``Fabric._validate_setup_optimizers`` refuses every ``DeepSpeedStrategy`` in ``setup_optimizers``;
  no public switch exists, so it is wrapped (when the first Fabric is built with ``HpzFabricStrategy``, not at
  import) and passes this package's strategy on (:func:`allow_separate_optimizer_setup`). ``_FabricOptimizer``
  (an optimizer set up twice), ``_get_deepspeed_engines_from_state`` (the engine Lightning's own save and load
  pick).
- **The connectors' ``_check_config_and_set_final_flags``**: the only place that sees an unknown ``strategy=`` name;
  wrapped to add "Did you mean 'hpz'?" to Lightning's own error (:func:`add_strategy_name_hints`).
- **Data and checkpoints**: ``_set_sampler_epoch`` (Lightning's own way to reach a loader's sampler),
  ``_DatasetSamplerWrapper._sampler`` (the user's sampler inside Lightning's distributed one),
  ``_Stateful`` (the protocol Lightning's loops check), ``_validate_checkpoint_directory`` (Lightning's own
  message for a file given where a DeepSpeed checkpoint folder is expected).
- **Lightning 2.5's public signatures**, handled here too: no ``weights_only`` in ``Strategy.load_checkpoint`` and
  the connector's ``resume_start`` (:func:`weights_only_argument`), and a checkpoint conversion that reads
  DeepSpeed's files with torch's ``weights_only=True`` default, which refuses them (:func:`convert_zero_checkpoint`).
- **``loops.utilities._distributed_is_initialized``**: replaced only by :mod:`lightning_hpz.strategy.testing`, so
  that a CPU test takes the CUDA branch of the evaluation loops (:func:`evaluation_loops_see_no_gloo`).

Registration is not here: ``StrategyRegistry.register`` and ``STRATEGY_REGISTRY`` are public, and the import hook
that calls them (``strategy/registration.py``) uses Python's import system only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Optional

import lightning
from lightning.fabric import Fabric
from lightning.fabric import connector as _fabric_connector
from lightning.fabric import strategies as _fabric_strategies
from lightning.fabric.strategies.deepspeed import _get_deepspeed_engines_from_state, _validate_checkpoint_directory
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful
from lightning.fabric.wrappers import _FabricOptimizer
from lightning.pytorch import strategies as _trainer_strategies
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors import accelerator_connector as _trainer_connector
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

SUPPORTED_LIGHTNING = ("2.5", "2.6")  # minor releases, as pyproject.toml's `lightning>=2.5,<2.7`
INSTALL_HINT = "pip install 'lightning>=2.5,<2.7'"

SubprocessScriptLauncher = _SubprocessScriptLauncher
BackwardSyncControl = _BackwardSyncControl
CheckpointConnector = _CheckpointConnector
FabricOptimizer = _FabricOptimizer
Stateful = _Stateful
set_sampler_epoch = _set_sampler_epoch
validate_checkpoint_directory = _validate_checkpoint_directory
plugin_to_compute_dtype = _plugin_to_compute_dtype
deepspeed_engines_in = _get_deepspeed_engines_from_state

_LOOP_UTILITIES = "lightning.pytorch.loops.utilities"
_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
# Lightning 2.6 added `fabric.setup(model, optimizer, scheduler)`: the strategy's engine build returns a third value
_FABRIC_SETS_UP_SCHEDULERS = (
    "scheduler" in inspect.signature(_fabric_strategies.DeepSpeedStrategy.setup_module_and_optimizers).parameters
)
_NAME_CHECK = "_check_config_and_set_final_flags"
_NAME_CONNECTORS = (_trainer_connector._AcceleratorConnector, _fabric_connector._Connector)
_SETUP_OPTIMIZERS_CHECK = "_validate_setup_optimizers"
_MARK = "_lightning_hpz_wrapped"


class IncompatibleLightningError(ImportError):
    """The installed Lightning is not one lightning_hpz supports, or lacks an internal it relies on."""


def check_lightning_version(version: str) -> None:
    """Refuse a Lightning release outside ``SUPPORTED_LIGHTNING``, naming the releases to install."""
    if ".".join(version.split(".")[:2]) not in SUPPORTED_LIGHTNING:
        raise IncompatibleLightningError(
            f"lightning_hpz supports Lightning {' and '.join(SUPPORTED_LIGHTNING)}, but Lightning {version} is "
            f"installed: {INSTALL_HINT}."
        )


def _required_internals() -> dict[str, tuple[Any, ...]]:
    """``"owner.name"`` -> the owners that must have it, for every internal this module reaches by attribute."""
    both = (_trainer_strategies.DeepSpeedStrategy, _fabric_strategies.DeepSpeedStrategy)
    trainer, fabric = both
    return {
        "DeepSpeedStrategy._configure_launcher": both,
        "DeepSpeedStrategy._init_deepspeed_distributed": both,
        "DeepSpeedStrategy._set_deepspeed_activation_checkpointing": both,
        "DeepSpeedStrategy._load_config": both,
        "DeepSpeedStrategy._setup_model_and_optimizer": (trainer,),
        "DeepSpeedStrategy._initialize_deepspeed_inference": (trainer,),
        "DeepSpeedStrategy._setup_distributed": (fabric,),
        "DeepSpeedStrategy._set_world_ranks": (fabric,),
        "DeepSpeedStrategy._format_config": (fabric,),
        "DeepSpeedStrategy._initialize_engine": (fabric,),
        f"connector.{_NAME_CHECK}": _NAME_CONNECTORS,
        f"Fabric.{_SETUP_OPTIMIZERS_CHECK}": (Fabric,),
        "Fabric._validate_launched": (Fabric,),
        "_CheckpointConnector._select_ckpt_path": (_CheckpointConnector,),
        "_CheckpointConnector._parse_ckpt_path": (_CheckpointConnector,),
        "_CheckpointConnector._hpc_resume_path": (_CheckpointConnector,),
        "ModelCheckpoint.__resolve_ckpt_dir": (ModelCheckpoint,),
        "loops.utilities._distributed_is_initialized": (importlib.import_module(_LOOP_UTILITIES),),
    }


def _attribute(name: str) -> str:
    attribute = name.rpartition(".")[2]
    return f"_ModelCheckpoint{attribute}" if attribute.startswith("__") else attribute


def check_lightning_internals() -> None:
    """Refuse a Lightning that lacks any internal listed in the module docstring."""
    missing = [
        name
        for name, owners in _required_internals().items()
        if not all(hasattr(owner, _attribute(name)) for owner in owners)
    ]
    if missing:
        raise IncompatibleLightningError(
            f"Lightning {lightning.__version__} lacks {', '.join(missing)}, which lightning_hpz relies on "
            f"(lightning_hpz/lightning_internals.py): {INSTALL_HINT}."
        )


check_lightning_version(lightning.__version__)
check_lightning_internals()


# ------------------------------------------------------------------------------------------ strategy hooks
class _SharedHooks:
    """The private hooks both DeepSpeed strategies have, each handed to a method of the package's own name."""

    def _configure_launcher(self) -> None:
        self.configure_launcher()

    def configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]

    def _init_deepspeed_distributed(self) -> None:
        self.init_deepspeed_distributed()

    def init_deepspeed_distributed(self) -> None:
        super()._init_deepspeed_distributed()  # type: ignore[misc]

    def _set_deepspeed_activation_checkpointing(self) -> None:
        self.configure_activation_checkpointing()

    def configure_activation_checkpointing(self) -> None:
        super()._set_deepspeed_activation_checkpointing()  # type: ignore[misc]

    def _load_config(self, config: Any) -> Any:
        return self.lightning_config(config)

    def lightning_config(self, config: Any) -> Any:
        """The config Lightning's ``__init__`` replaces its defaults by (``config=`` or the file it names)."""
        return super()._load_config(config)  # type: ignore[misc]


class TrainerDeepSpeedHooks(_SharedHooks, _trainer_strategies.DeepSpeedStrategy):
    """Lightning's Trainer ``DeepSpeedStrategy`` with its private hooks under the package's names."""

    def replace_launcher(self, launcher: Any) -> None:
        self._launcher = launcher

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        return self.setup_model_and_optimizer(model, optimizer, lr_scheduler)

    def setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    def _initialize_deepspeed_inference(self, model: Any) -> None:
        self.initialize_inference_engine(model)

    def initialize_inference_engine(self, model: Any) -> None:
        super()._initialize_deepspeed_inference(model)


class FabricDeepSpeedHooks(_SharedHooks, _fabric_strategies.DeepSpeedStrategy):
    """Fabric's ``DeepSpeedStrategy`` with its private hooks under the package's names (the Trainer's where it has
    public ones: ``setup_distributed``, ``set_world_ranks``, ``deepspeed_engine``)."""

    def _setup_distributed(self) -> None:
        self.setup_distributed()

    def setup_distributed(self) -> None:
        super()._setup_distributed()

    def set_world_ranks(self) -> None:
        self._set_world_ranks()

    def format_config_once(self) -> None:
        # as Lightning's `_setup_distributed` ends
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    def _format_config(self) -> None:
        self.format_config()

    def format_config(self) -> None:
        super()._format_config()

    def _initialize_engine(self, model: Any, optimizer: Any = None, scheduler: Any = None) -> tuple[Any, ...]:
        built = self.initialize_engine(model, optimizer, scheduler)
        return built if _FABRIC_SETS_UP_SCHEDULERS else built[:2]

    def initialize_engine(self, model: Any, optimizer: Any = None, scheduler: Any = None) -> tuple[Any, Any, Any]:
        """(engine, optimizer, scheduler), the scheduler None where Fabric sets up none (Lightning 2.5)."""
        if _FABRIC_SETS_UP_SCHEDULERS:
            return super()._initialize_engine(model, optimizer, scheduler)
        return (*super()._initialize_engine(model, optimizer), None)

    def setup_module_and_optimizers(self, module: Any, optimizers: Any, scheduler: Any = None) -> Any:
        if _FABRIC_SETS_UP_SCHEDULERS:
            return super().setup_module_and_optimizers(module, optimizers, scheduler)
        return super().setup_module_and_optimizers(module, optimizers)

    # Lightning's __init__ and Fabric's `backward` assign these; Fabric's `no_backward_sync` and its DeepSpeed
    # precision read them.
    @property
    def _backward_sync_control(self) -> Any:
        return self.backward_sync_control()

    @_backward_sync_control.setter
    def _backward_sync_control(self, control: Any) -> None:
        self.__dict__["lightning_backward_sync_control"] = control

    def backward_sync_control(self) -> Any:
        return self.__dict__.get("lightning_backward_sync_control")

    @property
    def _deepspeed_engine(self) -> Any:
        return self.__dict__.get("deepspeed_engine_kept")

    @_deepspeed_engine.setter
    def _deepspeed_engine(self, engine: Any) -> None:
        self.__dict__["deepspeed_engine_kept"] = self.engine_to_keep(engine)

    def engine_to_keep(self, engine: Any) -> Any:
        return engine

    @property
    def deepspeed_engine(self) -> Any:
        return self._deepspeed_engine

    @deepspeed_engine.setter
    def deepspeed_engine(self, engine: Any) -> None:
        self._deepspeed_engine = engine


def attached_trainer(module: Any) -> Optional[Any]:
    """The Trainer ``module`` (a LightningModule, or None) is attached to, or None (``module.trainer`` raises)."""
    return getattr(module, "_trainer", None)


def script_launcher_procs(launcher: Any) -> Optional[list[Any]]:
    """The ranks Lightning's script launcher started from this process, or None for another launcher."""
    return launcher.procs if isinstance(launcher, _SubprocessScriptLauncher) else None


# ------------------------------------------------------------------------------------------ Trainer internals
_LIGHTNING_25 = lightning.__version__.startswith("2.5.")


def convert_zero_checkpoint(checkpoint_dir: str, output_file: str) -> dict[str, Any]:
    """Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` (public), on 2.5 as on 2.6.

    Lightning 2.5 reads the checkpoint's files with ``torch.load``'s default, which since torch 2.6 is
    ``weights_only=True`` and refuses DeepSpeed's own classes in them; 2.6 passes ``weights_only=False``. On 2.5
    that default is lifted for this call alone (torch's documented ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``), to read
    the same files 2.6 reads.
    """
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    if not _LIGHTNING_25:
        return convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file)
    previous = os.environ.get(_NO_WEIGHTS_ONLY)
    os.environ[_NO_WEIGHTS_ONLY] = "1"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f".*{_NO_WEIGHTS_ONLY}")
            return convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file)
    finally:
        if previous is None:
            del os.environ[_NO_WEIGHTS_ONLY]
        else:
            os.environ[_NO_WEIGHTS_ONLY] = previous


def weights_only_argument(weights_only: Optional[bool]) -> dict[str, Any]:
    """``weights_only`` for Lightning's ``load_checkpoint``/``resume_start``: 2.6 takes it, 2.5 has none."""
    return {} if _LIGHTNING_25 else {"weights_only": weights_only}


class ExtensibleCheckpointConnector(_CheckpointConnector):
    """The Trainer's checkpoint connector, with its ckpt_path resolution under the package's names."""

    def _select_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        return self.select_ckpt_path(state_fn, ckpt_path, model_provided, model_connected)

    def select_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        return super()._select_ckpt_path(state_fn, ckpt_path, model_provided, model_connected)

    def _parse_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        return self.parse_ckpt_path(state_fn, ckpt_path, model_provided, model_connected)

    def parse_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        return super()._parse_ckpt_path(state_fn, ckpt_path, model_provided, model_connected)

    @property
    def hpc_resume_path(self) -> Optional[str]:
        return self._hpc_resume_path

    def resume_start(self, checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        # 2.6 adds `weights_only`; 2.5 takes the path alone: whatever the Trainer passes goes on unchanged
        super().resume_start(self.resolve_checkpoint_path(checkpoint_path), *args, **kwargs)

    def resolve_checkpoint_path(self, checkpoint_path: Any) -> Any:
        return checkpoint_path


def checkpoint_connector(trainer: Any) -> Any:
    return trainer._checkpoint_connector


@contextlib.contextmanager
def checkpoint_connector_extended(trainer: Any, extension: type[ExtensibleCheckpointConnector]) -> Iterator[None]:
    """``trainer``'s checkpoint connector is an ``extension`` while the block runs: the same object and state, so
    whoever holds it keeps a working one. Another subclass (a user's, or ours nested) is left as it is."""
    connector = trainer._checkpoint_connector
    if type(connector) is not _CheckpointConnector:
        yield
        return
    connector.__class__ = extension
    try:
        yield
    finally:
        connector.__class__ = _CheckpointConnector
        for name in set(vars(extension)) & set(vars(connector)):  # what the extension left on the instance
            del vars(connector)[name]


def resolve_ckpt_dir(callback: ModelCheckpoint, trainer: Any) -> Any:
    """The folder ``callback`` saves into, as Lightning's own ``"last"`` lookup finds it."""
    return callback._ModelCheckpoint__resolve_ckpt_dir(trainer)  # type: ignore[attr-defined]


def resolved_ckpt_path(trainer: Any) -> Optional[Any]:
    """``trainer.ckpt_path`` when set; else the resolved ``ckpt_path`` ``Trainer._run`` is running with (stored on
    the Trainer only after the strategy has built the engine); None outside such a call."""
    if trainer.ckpt_path:
        return trainer.ckpt_path
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path")
        frame = frame.f_back
    return None


def _register_nothing(*args: Any, **kwargs: Any) -> None:
    return None


def skip_lightning_signal_handlers(trainer: Any) -> None:
    """``Trainer._run`` registers none of Lightning's signal handlers until :func:`allow_lightning_signal_handlers`."""
    trainer._signal_connector.register_signal_handlers = _register_nothing


def allow_lightning_signal_handlers(trainer: Any) -> None:
    vars(trainer._signal_connector).pop("register_signal_handlers", None)


def should_accumulate(trainer: Any) -> bool:
    """Whether the current training batch ends without an optimizer step."""
    return trainer.fit_loop._should_accumulate()


def sampler_inside(wrapper: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper``."""
    return wrapper.dataset._sampler


# ------------------------------------------------------------------------------------------ Fabric internals
def fabric_strategy(fabric: Any) -> Any:
    return fabric._strategy


def allow_separate_optimizer_setup(check: Callable[[Any, Any], None]) -> None:
    """``fabric.setup_optimizers`` runs ``check(fabric, optimizers)`` instead of Fabric's own refusal when the
    strategy has ``builds_engine_in_two_steps``; every other strategy keeps Fabric's check. Installed once."""
    original = getattr(Fabric, _SETUP_OPTIMIZERS_CHECK)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def validate(fabric: Any, optimizers: Any) -> None:
        if getattr(fabric._strategy, "builds_engine_in_two_steps", False):
            fabric._validate_launched()
            check(fabric, optimizers)
        else:
            original(fabric, optimizers)

    setattr(validate, _MARK, True)
    setattr(Fabric, _SETUP_OPTIMIZERS_CHECK, validate)


# ------------------------------------------------------------------------------------------ name hints
def add_strategy_name_hints(hint: Callable[[ValueError, Any], None]) -> None:
    """The Trainer's and Fabric's check of ``strategy=`` call ``hint(error, strategy)`` on the ValueError they raise,
    before it propagates. Installed once per connector."""
    for connector in _NAME_CONNECTORS:
        check = getattr(connector, _NAME_CHECK)
        if not getattr(check, _MARK, False):
            setattr(connector, _NAME_CHECK, _hinting(check, hint))


def _hinting(check: Callable[..., None], hint: Callable[[ValueError, Any], None]) -> Callable[..., None]:
    @functools.wraps(check)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            check(self, *args, **kwargs)
        except ValueError as error:
            hint(error, kwargs.get("strategy", args[0] if args else None))
            raise

    setattr(checked, _MARK, True)
    return checked


# ------------------------------------------------------------------------------------------ test emulation
def evaluation_loops_see_no_gloo() -> Callable[[], None]:
    """Lightning's evaluation loops take their CUDA branch (``torch.inference_mode``) on a gloo process group, until
    the returned function is called: the name ``_no_grad_context`` looks up on each call answers "not distributed"."""
    utilities = importlib.import_module(_LOOP_UTILITIES)
    original = utilities._distributed_is_initialized
    utilities._distributed_is_initialized = _not_distributed

    def restore() -> None:
        utilities._distributed_is_initialized = original

    return restore


def _not_distributed(*args: Any, **kwargs: Any) -> bool:
    return False
