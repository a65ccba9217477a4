"""DeepSpeed's universal-format conversion, shared by the ranks of a job and resumable: each unit of its work runs on
one rank, is recorded when done, and a rerun skips the units it finds recorded.

``deepspeed.checkpoint.ds_to_universal.main`` works in two phases. Each phase hands a list of independent work items
to ``_do_parallel_work(do_work, work_chunks, num_workers)``, with ``do_work`` a ``functools.partial`` of a
module-level function. Extraction has one item per ZeRO shard file (``extract_zero_shards`` for stages 1-2,
``extract_zero_shards_stage3``) and writes each parameter's fragments into ``<output>/tmp``. Merging has one item per
parameter (``merge_tp_slices``, ``merge_zero3_slices``) and writes ``<output>/zero/<param>/*.pt``. Every file either
writes goes through ``_save_checkpoint(file_path, chkpt_sd)``, so the files an item wrote are known from the calls,
without listing a folder. An item writes the same files each time it runs, so once its outputs are durable and
recorded it need not run again. DeepSpeed deletes ``tmp`` only after every merge is done, so a rerun that skips
recorded extractions still finds their fragments.

While :func:`resumable_work` is active, ``_do_parallel_work`` is wrapped. For the items of those four functions it
skips each recorded item and returns the result the record holds (``merge_tp_slices`` returns the patterns it left
unused, for DeepSpeed's check). Each other item runs through :func:`_recorded_item`: the item runs, its outputs are
``fsync``ed, then a record is written under a temporary name and renamed. Other calls to ``_do_parallel_work`` pass
through unchanged. Importing this module patches nothing, and the wrapper is removed when the block ends.

Shared by a team (:class:`Team`): the process running ``main`` (rank 0) deals each phase's pending items and hands
them, with the work function and the deal, to the others (:func:`work_share` runs their part). Extraction item ``i``
runs on rank ``i mod size`` (ZeRO shard ``r`` on rank ``r`` when the sizes match). Merges are dealt by size, largest
first, each to the rank with the fewest weights so far: a merge reads and writes its parameter's whole state, and
the embedding of a 70B model weighs as much as 16 of its query projections. The sizes are DeepSpeed's own: a ZeRO-1/2
item carries its shapes, ZeRO-3's are those ``main`` parses from the model-state file (``_parse_model_states_stage3``).
Rank 0 waits for every rank's part before ``main`` goes on, then reads the others' results from their records.
Everything else ``main`` does (its set-up reads, the optimizer state, the copies of the model files) stays on rank 0.

At import, the installed converter is checked: its version, and the functions with the parameters read here. If
anything differs, :data:`UNSUPPORTED_REASON` says why and :func:`resumable_work` patches nothing. The conversion
then runs from the start on rank 0 alone, as DeepSpeed ships it. This is never an error, since sharing and resuming
only save time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

import deepspeed
from deepspeed.checkpoint import ds_to_universal as converter
from packaging.version import Version

from lightning_hpz import collectives
from lightning_hpz.durability import persist_directory, persist_file

# the releases whose converter was read for this (0.19.8); the others convert from the start
READ_AGAINST_MIN = Version("0.19.0")
READ_AGAINST_BELOW = Version("0.20.0")
DISPATCHER = ("_do_parallel_work", ("do_work", "work_chunks", "num_workers"))
WRITER = ("_save_checkpoint", ("file_path", "chkpt_sd"))
WRITING = ("dump_param_fragment", "merge_tp_slices", "merge_zero3_slices")  # each writes through WRITER
SHAPES = ("_parse_model_states_stage3", ("files",))  # ZeRO-3: the list of {name: shape} main merges by


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
            "whose converter lightning_hpz shares and records item by item"
        )
    expected = {name: phase.parameters for name, phase in ITEM_FUNCTIONS.items()}
    for name, parameters in [*expected.items(), DISPATCHER, WRITER, SHAPES]:
        function = getattr(converter, name, None)
        if not callable(function) or tuple(inspect.signature(function).parameters) != parameters:
            return f"DeepSpeed {deepspeed.__version__} has no `ds_to_universal.{name}{parameters}`"
    for name in WRITING:
        if f"{WRITER[0]}(" not in inspect.getsource(getattr(converter, name)):
            return f"DeepSpeed {deepspeed.__version__}'s `ds_to_universal.{name}` does not write through {WRITER[0]}"
    return ""


UNSUPPORTED_REASON = _unsupported_reason()


class Team(Protocol):
    """The ranks sharing a conversion; rank 0 runs DeepSpeed's ``main``. A phase is handed out by rank 0
    (``hand_out``), taken by each other rank (``take``: None once rank 0 hands out no more) and reported done by it
    (``done``, with what failed); rank 0 then waits for all of them (``wait``: what failed, empty if nothing)."""

    rank: int
    size: int

    def hand_out(self, payload: bytes) -> int: ...

    def take(self) -> Optional[tuple[int, bytes]]: ...

    def done(self, phase: int, failure: str) -> None: ...

    def wait(self, phase: int) -> str: ...


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
    records: Path,
    report: Callable[[str], None],
    on_item_written: Optional[Callable[[list[Path]], dict[str, Any]]] = None,
    team: Optional[Team] = None,
) -> Iterator[Optional[ConversionProgress]]:
    """Within this block, DeepSpeed's conversion records each item it completes under ``records`` and skips those
    recorded by an earlier attempt; with a ``team``, each item runs on one of its ranks. ``report`` receives a line as
    each phase starts and ends. ``on_item_written`` receives the files of a merged parameter once they are durable,
    before its record is written, and returns what the record keeps of each (by path relative to the records'
    parent); it must be a module-level function, since it travels to the team with the work. Yields the progress,
    or None, patching nothing, when :data:`UNSUPPORTED_REASON` is set."""
    if UNSUPPORTED_REASON:
        yield None
        return
    progress = ConversionProgress()
    original = converter._do_parallel_work
    converter._do_parallel_work = functools.partial(
        _dispatch, original, Path(records), progress, report, on_item_written, team
    )
    try:
        with _writes_recorded(), _shapes_noted():
            yield progress
    finally:
        converter._do_parallel_work = original


def work_share(team: Team) -> None:
    """A rank other than 0: run this rank's items of each phase rank 0 hands out, until it hands out no more."""
    with _writes_recorded():
        while (handed := team.take()) is not None:
            phase, payload = handed
            failure = ""
            try:
                work, items, ranks = pickle.loads(payload)
                for item in _share(items, ranks, team.rank):
                    work(item)
            except Exception as error:  # reported to rank 0, which fails the conversion on every rank
                failure = f"rank {team.rank}: {type(error).__name__}: {error}"
            team.done(phase, failure)


def recorded_files(records: Path) -> dict[str, Any]:
    """What the records keep of each merged file (``on_item_written``'s), by path relative to the records' parent."""
    return {
        name: kept
        for phase, spec in ITEM_FUNCTIONS.items()
        if spec.verb == "merging"
        for record in _read_records(records / phase).values()
        for name, kept in record.get("files", {}).items()
    }


def _dispatch(original, records, progress, report, on_item_written, team, do_work, work_chunks, num_workers) -> list:
    """``_do_parallel_work`` with the items of an item function shared, recorded, and those recorded before skipped."""
    name = next((name for name in ITEM_FUNCTIONS if getattr(do_work, "func", None) is getattr(converter, name)), None)
    if name is None:
        return original(do_work, work_chunks, num_workers)
    phase, output = ITEM_FUNCTIONS[name], _output_folder(do_work, ITEM_FUNCTIONS[name])
    items, done = list(work_chunks), _read_records(records / name)
    if phase.verb == "merging":
        _remove_unrecorded_outputs(output, records.parent, done)
    pending = [(index, item) for index, item in enumerate(items) if _item_key(item) not in done]
    progress.phases[name] = (len(items), len(items) - len(pending))
    skipped = f" ({len(items) - len(pending)} done before, skipped)" if len(pending) < len(items) else ""
    shared = f" on {team.size} ranks" if team is not None else ""
    report(f"Universal conversion: {phase.verb} {len(items)} {phase.noun}s{shared}{skipped}")
    started = time.monotonic()
    work = functools.partial(_recorded_item, records / name, do_work, on_item_written, phase.verb == "merging")
    results = _run_shared(work, pending, _ranks_of(pending, team.size, phase) if team is not None else [], team)
    if team is not None and len(results) < len(pending):
        done = _read_records(records / name)  # the other ranks' results
    report(f"Universal conversion: {phase.verb} done in {time.monotonic() - started:.0f} s")
    return [results[key] if key in results else _decoded(done[key]) for key in map(_item_key, items)]


def _run_shared(
    work: Callable[[Any], Any], pending: list[tuple[int, Any]], ranks: list[int], team: Optional[Team]
) -> dict[str, Any]:
    """Run rank 0's items of ``pending`` here and, with a team, have its other ranks run theirs (``ranks``: the rank
    of each item); returns the results of the items run here, by key."""
    if team is None:
        return {_item_key(item): work(item) for _, item in pending}
    phase = team.hand_out(pickle.dumps((work, pending, ranks)))
    try:
        results = {_item_key(item): work(item) for item in _share(pending, ranks, 0)}
    finally:
        failure = team.wait(phase)  # the others are still writing into the copy otherwise
    if failure:
        raise RuntimeError(f"Universal conversion failed on another rank ({failure})")
    return results


def _share(pending: list[tuple[int, Any]], ranks: list[int], rank: int) -> list[Any]:
    return [item for (_, item), dealt in zip(pending, ranks, strict=True) if dealt == rank]


def _ranks_of(pending: list[tuple[int, Any]], size: int, phase: _Phase) -> list[int]:
    """The rank of each pending item: merges dealt by size; extraction item ``i`` (ZeRO shard ``i``) on rank
    ``i mod size``, also on a rerun that skips the items done before, so each rank reads its own shard."""
    if phase.verb == "merging":
        return collectives.balanced_deal([_weight(item) for _, item in pending], size)
    return [index % size for index, _ in pending]


_shapes: dict[str, Any] = {}  # ZeRO-3: each parameter's shape, by name, as DeepSpeed's main parsed it in this process


@contextlib.contextmanager
def _shapes_noted() -> Iterator[None]:
    original = getattr(converter, SHAPES[0])
    setattr(converter, SHAPES[0], functools.partial(_parse_noted, original))
    try:
        yield
    finally:
        setattr(converter, SHAPES[0], original)
        _shapes.clear()


def _parse_noted(original: Callable[[Any], Any], files: Any) -> Any:
    shapes = original(files)
    for group in shapes if isinstance(shapes, list) else []:  # one {name: shape} per optimizer sub-group
        if isinstance(group, dict):  # another layout only loses the weights: the deal is then by count
            _shapes.update(group)
    return shapes


def _weight(item: Any) -> int:
    """How many weights a merge item merges: a ZeRO-1/2 item (name, shapes) carries its shapes, a ZeRO-3 item (a
    name) has DeepSpeed's record of them; 1 where neither is known (the deal is then by count)."""
    return _numel(_shapes.get(item)) if isinstance(item, str) else _numel(item[1])


def _numel(shape: Any) -> int:
    """Elements of a shape (``torch.Size`` or ints), or of a list of shapes (one per tensor-parallel rank)."""
    if shape is None:
        return 1
    if all(isinstance(dimension, int) for dimension in shape):
        return math.prod(shape)
    return sum(_numel(part) for part in shape)


def _output_folder(do_work: functools.partial, phase: _Phase) -> Path:
    bound = inspect.signature(do_work.func).bind_partial(*do_work.args, **do_work.keywords)
    return Path(bound.arguments[phase.output])


_written: list[str] = []  # the files the current item wrote, in this process


@contextlib.contextmanager
def _writes_recorded() -> Iterator[None]:
    original = converter._save_checkpoint
    converter._save_checkpoint = functools.partial(_save_noted, original)
    try:
        yield
    finally:
        converter._save_checkpoint = original


def _save_noted(original: Callable[[str, Any], None], file_path: str, chkpt_sd: Any) -> None:
    original(file_path, chkpt_sd)
    _written.append(file_path)


def _recorded_item(records: Path, do_work, on_item_written, merging: bool, item) -> Any:
    """Run one item, make what it wrote durable, then record it: its result, when a record can hold it, and for a
    merge the files it wrote, with what ``on_item_written`` keeps of each."""
    _written.clear()
    result = do_work(item)
    files = sorted(set(map(Path, _written)))
    for path in files:
        persist_file(path)
    kept = on_item_written(files if merging else []) if on_item_written is not None else {}
    encoded = _encoded(result)
    if encoded is not None:
        record = {"item": _item_key(item), **encoded}
        if merging:
            record["files"] = {os.path.relpath(path, records.parent.parent): kept.get(str(path)) for path in files}
        _write_record(records, record)
    return result


def _item_key(item: Any) -> str:
    """A parameter's name (merging: the name, or the name and its shapes), or a shard's ``pp-tp-dp`` indices."""
    if isinstance(item, str):
        return item
    return item[0] if isinstance(item[0], str) else "-".join(map(str, item))


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


def _remove_unrecorded_outputs(output: Path, root: Path, done: dict[str, dict[str, Any]]) -> None:
    """Before merging again, remove from ``zero/`` what no record accounts for. DeepSpeed writes the weights of
    parameters without optimizer state after the merges, only where no file is found. A file cut short by a kill
    there would otherwise be kept."""
    for folder in [path for path in output.iterdir() if path.is_dir()] if output.is_dir() else []:
        if folder.name not in done:
            shutil.rmtree(folder)
            continue
        kept = set(done[folder.name].get("files", ()))
        for path in folder.iterdir():
            if os.path.relpath(path, root) not in kept:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
