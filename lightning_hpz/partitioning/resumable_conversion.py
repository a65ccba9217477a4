"""DeepSpeed's universal-format conversion, made resumable: each unit of its work is recorded when done, and a rerun
skips the units it finds recorded.

``deepspeed.checkpoint.ds_to_universal.main`` works in two phases. Each phase hands a list of independent work items
to ``_do_parallel_work(do_work, work_chunks, num_workers)``, with ``do_work`` a ``functools.partial`` of a
module-level function. Extraction has one item per ZeRO shard file (``extract_zero_shards`` for stages 1-2,
``extract_zero_shards_stage3``) and writes each parameter's fragments into ``<output>/tmp``. Merging has one item per
parameter (``merge_tp_slices``, ``merge_zero3_slices``) and writes ``<output>/zero/<param>/*.pt``. An item writes the
same files each time it runs, so once its outputs are durable and recorded it need not run again. DeepSpeed deletes
``tmp`` only after every merge is done, so a rerun that skips recorded extractions still finds their fragments.

While :func:`resumable_work` is active, ``_do_parallel_work`` is wrapped. For the items of those four functions it
skips each recorded item and returns the result the record holds (``merge_tp_slices`` returns the patterns it left
unused, for DeepSpeed's check). Each other item runs through :func:`_recorded_item`: the item runs, its outputs are
``fsync``ed, then a record is written under a temporary name and renamed. The dispatcher is wrapped, not each
function, for two reasons: it knows each phase's size, for the progress line, and what it passes on is a partial of
a function of this module, which a worker pool (``num_workers > 1``) can pickle, so the items are recorded in pool
workers too. Other calls to ``_do_parallel_work`` pass through unchanged. Importing this module patches nothing, and
the wrapper is removed when the block ends.

At import, the installed converter is checked: its version, and the five functions with the parameters read here.
If anything differs, :data:`UNSUPPORTED_REASON` says why and :func:`resumable_work` patches nothing. The conversion
then runs from the start, as DeepSpeed ships it. This is never an error, since resuming only saves time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import deepspeed
from deepspeed.checkpoint import ds_to_universal as converter
from packaging.version import Version

from lightning_hpz.durability import persist_directory, persist_file

# the releases whose converter was read for this (0.19.8); the others convert from the start
READ_AGAINST_MIN = Version("0.19.0")
READ_AGAINST_BELOW = Version("0.20.0")
DISPATCHER = ("_do_parallel_work", ("do_work", "work_chunks", "num_workers"))


@dataclass(frozen=True)
class _Phase:
    parameters: tuple[str, ...]  # the item function's, in order
    output: str  # the parameter naming the folder its items write into
    verb: str  # for the progress line: "<verb> 6 <noun>s"
    noun: str


ITEM_FUNCTIONS = {
    "extract_zero_shards": _Phase(("dir", "ds_checkpoint", "indices_3D"), "dir", "extracting", "ZeRO shard"),
    "extract_zero_shards_stage3": _Phase(
        ("optim_files_grid", "param_shapes_grid", "dp_degree", "temp_dir", "indices", "exclude_param_names"),
        "temp_dir",
        "extracting",
        "ZeRO shard",
    ),
    "merge_tp_slices": _Phase(
        ("uc_info", "dir", "slice_dir", "tp_degree", "name_and_shapes"), "dir", "merging", "parameter"
    ),
    "merge_zero3_slices": _Phase(("dp_degree", "dir", "slice_dir", "name"), "dir", "merging", "parameter"),
}


def _unsupported_reason() -> str:
    version = Version(Version(deepspeed.__version__).base_version)
    if not READ_AGAINST_MIN <= version < READ_AGAINST_BELOW:
        return (
            f"DeepSpeed {deepspeed.__version__} is outside >={READ_AGAINST_MIN},<{READ_AGAINST_BELOW}, the releases "
            "whose converter lightning_hpz records item by item"
        )
    expected = {name: phase.parameters for name, phase in ITEM_FUNCTIONS.items()}
    for name, parameters in [*expected.items(), DISPATCHER, ("dp_index_to_str", ("dp_index",))]:
        function = getattr(converter, name, None)
        if not callable(function) or tuple(inspect.signature(function).parameters) != parameters:
            return f"DeepSpeed {deepspeed.__version__} has no `ds_to_universal.{name}{parameters}`"
    return ""


UNSUPPORTED_REASON = _unsupported_reason()


@dataclass
class ConversionProgress:
    """Per phase this attempt reached: the number of items and how many of them an earlier attempt had done."""

    phases: dict[str, tuple[int, int]] = field(default_factory=dict)

    def resumed(self) -> bool:
        return any(done_before for _, done_before in self.phases.values())

    def summary(self) -> str:
        done = [f"{before} of {items} {ITEM_FUNCTIONS[name].noun}s" for name, (items, before) in self.phases.items()]
        return f"{' and '.join(done)} were done before and skipped"


@contextlib.contextmanager
def resumable_work(
    records: Path, report: Callable[[str], None], on_item_written: Optional[Callable[[], None]] = None
) -> Iterator[Optional[ConversionProgress]]:
    """Within this block, DeepSpeed's conversion records each item it completes under ``records`` and skips those
    recorded by an earlier attempt. ``report`` receives a line as each phase starts and ends. ``on_item_written`` is
    called after an item's outputs are durable and before its record is written; it must be a module-level function
    so that a worker pool can pickle it. Yields the progress, or None, patching nothing, when
    :data:`UNSUPPORTED_REASON` is set."""
    if UNSUPPORTED_REASON:
        yield None
        return
    progress = ConversionProgress()
    original = converter._do_parallel_work
    converter._do_parallel_work = functools.partial(
        _dispatch, original, Path(records), progress, report, on_item_written
    )
    try:
        yield progress
    finally:
        converter._do_parallel_work = original


def _dispatch(original, records, progress, report, on_item_written, do_work, work_chunks, num_workers) -> list:
    """``_do_parallel_work`` with the items of an item function recorded, and those recorded before skipped."""
    name = next((name for name in ITEM_FUNCTIONS if getattr(do_work, "func", None) is getattr(converter, name)), None)
    if name is None:
        return original(do_work, work_chunks, num_workers)
    phase, output = ITEM_FUNCTIONS[name], _output_folder(do_work, ITEM_FUNCTIONS[name])
    items, done = list(work_chunks), _read_records(records / name)
    if phase.verb == "merging":
        _remove_unrecorded_outputs(output, done)
    pending = [item for item in items if _item_key(item) not in done]
    progress.phases[name] = (len(items), len(items) - len(pending))
    skipped = f" ({len(items) - len(pending)} done before, skipped)" if len(pending) < len(items) else ""
    report(f"Universal conversion: {phase.verb} {len(items)} {phase.noun}s{skipped}")
    started = time.monotonic()
    work = functools.partial(_recorded_item, records / name, output, do_work, on_item_written)
    results = dict(zip(map(_item_key, pending), original(work, pending, num_workers), strict=True))
    report(f"Universal conversion: {phase.verb} done in {time.monotonic() - started:.0f} s")
    return [results[key] if key in results else _decoded(done[key]) for key in map(_item_key, items)]


def _output_folder(do_work: functools.partial, phase: _Phase) -> Path:
    bound = inspect.signature(do_work.func).bind_partial(*do_work.args, **do_work.keywords)
    return Path(bound.arguments[phase.output])


def _recorded_item(records: Path, output: Path, do_work, on_item_written, item) -> Any:
    """Run one item, make what it wrote durable, then record it (with its result, when a record can hold it)."""
    result = do_work(item)
    files = _outputs_of(output, item)
    for path in files:
        persist_file(path)
    if on_item_written is not None:
        on_item_written()
    encoded = _encoded(result)
    if encoded is not None:
        record = {"item": _item_key(item), **encoded, "files": [str(path.relative_to(output)) for path in files]}
        _write_record(records, record)
    return result


def _item_key(item: Any) -> str:
    """A parameter's name (merging: the name, or the name and its shapes), or a shard's ``pp-tp-dp`` indices."""
    if isinstance(item, str):
        return item
    return item[0] if isinstance(item[0], str) else "-".join(map(str, item))


def _outputs_of(output: Path, item: Any) -> list[Path]:
    """The files an item wrote: a merge's ``zero/<param>/*``, an extraction's ``tmp/*/<tp>/*.<dp>`` fragments."""
    if isinstance(item, str) or isinstance(item[0], str):
        folder = output / _item_key(item)
        return sorted(path for path in folder.iterdir() if path.is_file()) if folder.is_dir() else []
    tp_index, dp_index = item[-2], item[-1]
    return sorted(output.glob(f"*/{tp_index}/*.{converter.dp_index_to_str(dp_index)}"))


def _encoded(result: Any) -> Optional[dict[str, Any]]:
    """A result a record can hold: None, or a set of strings. Any other result is not recorded, so its item runs
    again next time."""
    if result is None:
        return {"result": None}
    if isinstance(result, (set, frozenset)) and all(isinstance(value, str) for value in result):
        return {"result": sorted(result), "set": True}
    return None


def _decoded(record: dict[str, Any]) -> Any:
    return set(record["result"]) if record.get("set") else record["result"]


def _write_record(records: Path, record: dict[str, Any]) -> None:
    records.mkdir(parents=True, exist_ok=True)
    name = hashlib.blake2b(record["item"].encode(), digest_size=10).hexdigest()
    temporary = records / f"{name}.tmp"
    temporary.write_text(json.dumps(record))
    persist_file(temporary)
    os.replace(temporary, records / f"{name}.json")
    persist_directory(records)


def _read_records(records: Path) -> dict[str, dict[str, Any]]:
    found = (json.loads(path.read_text()) for path in records.glob("*.json"))
    return {record["item"]: record for record in found}


def _remove_unrecorded_outputs(output: Path, done: dict[str, dict[str, Any]]) -> None:
    """Before merging again, remove from ``zero/`` what no record accounts for. DeepSpeed writes the weights of
    parameters without optimizer state after the merges, only where no file is found. A file cut short by a kill
    there would otherwise be kept."""
    for folder in [path for path in output.iterdir() if path.is_dir()] if output.is_dir() else []:
        if folder.name not in done:
            shutil.rmtree(folder)
            continue
        kept = set(done[folder.name]["files"])
        for path in folder.iterdir():
            if str(path.relative_to(output)) not in kept:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
