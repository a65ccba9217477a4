"""How the ranks reach one answer about a checkpoint without any rank left waiting in a collective.

A check or a file operation that runs on some ranks and fails on one would leave the others in the next collective
until the process group times out. Here: a step rank 0 takes alone (:func:`on_rank_zero`) returns its result, or its
error, on every rank; a step rank 0 takes for all (:func:`dealt_by_rank_zero`) hands each rank its own part of the
result, or the error; a check every rank takes part in (:func:`problems_found_together`) gathers every rank's
findings into one list, the same on every rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, TypeVar

from lightning_hpz import collectives
from lightning_hpz.checkpointing import manifest
from lightning_hpz.checkpointing.errors import CheckpointStorageError

Result = TypeVar("Result")


def on_rank_zero(step: Callable[[], Result], failure: str, errors: tuple[type[Exception], ...] = (OSError,)) -> Result:
    """Run ``step`` on rank 0 alone; its result on every rank. An ``errors`` exception there is raised on every rank
    as :class:`CheckpointStorageError` ``"<failure>: <error>"``."""
    outcome: Any = None
    if collectives.rank() == 0:
        try:
            outcome = {"result": step()}
        except errors as error:
            outcome = {"error": f"{failure}: {error}"}
    outcome = collectives.broadcast_object(outcome)
    if "error" in outcome:
        raise CheckpointStorageError(outcome["error"])
    return outcome["result"]


def agreed(problems: list[str]) -> list[str]:
    """Every rank's problems, in rank order without repeats: the same list on every rank.

    One all-reduce of a single number when no rank found any (the usual case): only then does a load cost each rank
    O(1) bytes here at any world size; the lists themselves travel only when some rank has one."""
    if not collectives.all_reduce_values([float(bool(problems))], op="max")[0]:
        return []
    merged: list[str] = []
    for part in collectives.all_gather_object(problems):
        merged += [p for p in part if p not in merged]
    return merged


def dealt_by_rank_zero(deal: Callable[[], list[Result]]) -> Result:
    """Run ``deal`` on rank 0 alone, which returns one object per rank; each rank's own object, in one scatter (each
    rank receives O(its own part), not the whole). Whatever ``deal`` raises there is raised on every rank alike."""
    dealt: Any = None
    failure: Optional[Exception] = None
    if collectives.rank() == 0:
        try:
            dealt = [{"result": part} for part in deal()]
        except Exception as error:  # any error, or the other ranks would wait in the scatter until the timeout
            failure = error
            dealt = [{"error": _portable(error)}] * collectives.world_size()
    mine = collectives.scatter_object(dealt)
    if failure is not None:
        raise failure  # rank 0's own, with its traceback
    if "error" in mine:
        raise mine["error"]
    return mine["result"]


def _portable(error: Exception) -> Exception:
    """``error`` if it survives pickling, else a RuntimeError with its type and text (a scatter of an object that
    cannot be pickled would fail on rank 0 alone)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def verification_shares(recorded: dict[str, Any], world_size: int) -> list[list[str]]:
    """The files each rank checksums when every file must be checked (a resize, a staged or converted copy), by rank:
    the largest first, each to the rank with the fewest bytes so far, so that every rank reads about the same number
    of bytes (a split by name left stage 3's odd ranks every optimizer shard). The same for the same manifest."""
    names = sorted(recorded["files"])
    ranks = collectives.balanced_deal([int(recorded["files"][name]["size"]) for name in names], world_size)
    shares: list[list[str]] = [[] for _ in range(world_size)]
    for name, rank in zip(names, ranks, strict=True):
        shares[rank].append(name)
    return shares


def manifest_shares(
    folder: Path, read: Callable[[Path], Optional[dict[str, Any]]] = manifest.read_manifest
) -> Optional[dict[str, Any]]:
    """Collective: this rank's share, balanced by bytes, of the entries of ``folder``'s manifest (``{name: entry}``),
    which rank 0 alone reads (with ``read``); None on every rank when there is none. An error reading it is raised on
    every rank."""

    def deal() -> list[Optional[dict[str, Any]]]:
        recorded = read(folder)
        if recorded is None:
            return [None] * collectives.world_size()
        shares = verification_shares(recorded, collectives.world_size())
        return [{name: recorded["files"][name] for name in share} for share in shares]

    return dealt_by_rank_zero(deal)


def problems_found_together(folder: Path, share: dict[str, dict[str, Any]]) -> list[str]:
    """Collective: each rank checksums its ``share`` (``{name: manifest entry}``, from :func:`manifest_shares`) of
    the files in ``folder``; one sentence per damaged or missing file (or unreadable share), the same on every rank."""
    try:
        problems = manifest.verify_files(folder, {"files": share}, list(share))
    except OSError as error:  # raised on this rank alone, the others would wait in the gather
        problems = [f"{folder}: cannot be read ({error})"]
    return agreed(problems)
