"""Rank 0 reads a checkpoint's manifest once and deals each rank its own entries: which files each rank is sent, what
that costs per rank at 2, 4 and 1,024 ranks, and a damaged manifest refused (in one process; the scatter over real
ranks is tested in tests/test_collectives.py and tests/test_checkpoint_trust.py)."""

import json
import pickle

import pytest

from lightning_hpz.checkpointing.errors import CheckpointIntegrityError
from lightning_hpz.checkpointing.manifest import MANIFEST_NAME, files_read_by_each
from lightning_hpz.checkpointing.rank_agreement import dealt_by_rank_zero, verification_shares
from lightning_hpz.checkpointing.resume import _entry_lookup, _manifest_dealt

ENTRY = {"size": 1 << 30, "blake2b": "0" * 32}  # one size for all: the pickled payloads then differ only by names
# a 70B model's description: 80 layers of 9 tensors (what the manifest's "run" records, and a resume compares)
PARAMETERS = {f"layers.{layer}.{name}": [8192, 8192] for layer in range(80) for name in "qkvoabcde"}


def _model_states(rank: int) -> str:
    return f"checkpoint/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _optimizer_shard(rank: int) -> str:
    return f"checkpoint/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _zero_3_names(ranks: int) -> list[str]:
    return sorted(["latest", *map(_model_states, range(ranks)), *map(_optimizer_shard, range(ranks))])


def _run(ranks: int, stage: int = 3) -> dict:
    return {"stage": stage, "world_size": ranks, "optimizer": "AdamW", "param_groups": None, "parameters": PARAMETERS}


def _written(folder, ranks: int, stage: int = 3):
    folder.mkdir(parents=True)
    files = {name: ENTRY for name in _zero_3_names(ranks)}
    (folder / MANIFEST_NAME).write_text(json.dumps({"format": 1, "run": _run(ranks, stage), "files": files}))
    return folder


@pytest.mark.parametrize("ranks", [2, 4, 1024])
def test_each_rank_reads_its_own_shards_and_the_shared_files(ranks):
    each = files_read_by_each(_zero_3_names(ranks), ranks)
    assert each == [sorted(["latest", _model_states(rank), _optimizer_shard(rank)]) for rank in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 4, 1024])
def test_under_zero_2_every_rank_reads_the_one_model_state_file(ranks):
    names = ["latest", "checkpoint/mp_rank_00_model_states.pt", *map(_optimizer_shard, range(ranks))]
    each = files_read_by_each(names, ranks)
    assert each == [sorted([*names[:2], _optimizer_shard(rank)]) for rank in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 4, 1024])
def test_elastic_checkpoint_has_every_rank_read_every_optimizer_shard(ranks):
    # ZeRO's elastic_checkpoint: DeepSpeed reads all of them on every rank (covered here only: DeepSpeed 0.19.8 fails
    # inside its own elastic load, `_restore_step_from_elastic_checkpoint`, with AdamW's per-parameter step)
    each = files_read_by_each(_zero_3_names(ranks), ranks, every_optimizer_shard=True)
    optimizer = list(map(_optimizer_shard, range(ranks)))
    assert each == [sorted(["latest", _model_states(rank), *optimizer]) for rank in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 4, 1024])
def test_verification_shares_cover_each_file_once_balanced_by_bytes(ranks):
    names = _zero_3_names(1024)  # the resize of a 1,024-rank checkpoint onto ``ranks``
    sizes = {name: 1000 if "optim" in name else 10 for name in names} | {"latest": 1}
    shares = verification_shares({"files": {name: {"size": size} for name, size in sizes.items()}}, ranks)
    assert sorted(name for share in shares for name in share) == names
    loads = [sum(sizes[name] for name in share) for share in shares]
    assert max(loads) - min(loads) <= 1000


def test_each_rank_is_dealt_its_own_entries_the_same_bytes_at_any_world_size(tmp_path):
    # O(own files) per rank: the payload does not grow with the number of ranks (the digits of the rank aside)
    payloads = {}
    for ranks in (2, 4, 1024):
        dealt = _manifest_dealt(_written(tmp_path / str(ranks), ranks), _run(ranks), every_optimizer_shard=False)
        assert [sorted(part["files"]) for part in dealt] == files_read_by_each(_zero_3_names(ranks), ranks)
        payloads[ranks] = [len(pickle.dumps(part)) for part in dealt]
    assert len(set(payloads[2] + payloads[4])) == 1 and payloads[2][0] < 600  # the parameters' shapes stay on rank 0
    assert max(payloads[1024]) - payloads[2][0] <= 2 * 3 + 1  # two names' 3 more digits; world size 1024 > 1 byte


def test_a_resize_deals_each_rank_a_share_of_every_file(tmp_path):
    dealt = _manifest_dealt(_written(tmp_path / "ckpt", 4), _run(2), every_optimizer_shard=False)
    assert sorted(name for part in dealt for name in part["files"]) == _zero_3_names(4)
    assert all(part["run"] == {"world_size": 4, "optimizer": "AdamW", "param_groups": None} for part in dealt)


def test_without_a_manifest_every_rank_is_dealt_the_run_its_file_names_tell(tmp_path):
    (tmp_path / "ckpt" / "checkpoint").mkdir(parents=True)
    for name in _zero_3_names(2):
        (tmp_path / "ckpt" / name).touch()
    dealt = _manifest_dealt(tmp_path / "ckpt", _run(2), every_optimizer_shard=False)
    run = {"world_size": 2, "optimizer": None, "param_groups": None}
    assert dealt == [{"run": run, "mismatches": [], "files": None}] * 2


def test_rank_zero_finds_the_mismatches_and_deals_them_to_every_rank(tmp_path):
    # the same list on every rank, found without a collective, and no rank but 0 holds the run's description
    dealt = _manifest_dealt(_written(tmp_path / "ckpt", 2, stage=2), _run(2), every_optimizer_shard=False)
    assert [len(part["mismatches"]) for part in dealt] == [1, 1]
    assert "written with stage 2, this run uses stage 3" in dealt[1]["mismatches"][0]


@pytest.mark.parametrize(
    "text",
    [
        '{"format": 1, "files": {"lat',
        "[]",
        '{"format": 1}',
        # one malformed entry: refused by rank 0 for all, not by the one rank it would be dealt to
        '{"format": 1, "run": {"world_size": 2}, "files": {"latest": {"size": "many", "blake2b": "0"}}}',
        '{"format": 1, "run": {"world_size": 2}, "files": {"latest": {"size": 3}}}',
    ],
)
def test_a_damaged_manifest_is_an_integrity_error(tmp_path, text):
    folder = _written(tmp_path / "step=4.ckpt", 2)
    (folder / MANIFEST_NAME).write_text(text)
    with pytest.raises(
        CheckpointIntegrityError, match=r"is damaged, refusing to load it\. .*hpz_manifest.json: cannot"
    ):
        dealt_by_rank_zero(lambda: _manifest_dealt(folder, _run(1), every_optimizer_shard=False))


def test_a_file_not_dealt_is_looked_up_in_the_manifest_on_this_rank(tmp_path):
    # DeepSpeed reading a file the split did not predict: slower (this rank reads the manifest), never unverified
    folder = _written(tmp_path / "ckpt", 2)
    entry = _entry_lookup(folder, {"latest": ENTRY})
    (folder / MANIFEST_NAME).rename(folder / "moved")
    assert entry("latest") == ENTRY  # dealt: no file call
    with pytest.raises(CheckpointIntegrityError, match="disappeared while"):
        entry(_optimizer_shard(1))
    (folder / "moved").rename(folder / MANIFEST_NAME)
    assert entry(_optimizer_shard(1)) == ENTRY and entry("not/in/the/manifest.pt") is None


def test_an_empty_or_short_own_file_is_a_problem_agreed_on_not_an_error_on_its_rank(tmp_path):
    import contextlib

    from lightning_hpz.checkpointing.resume import _own_files_verified

    folder = tmp_path / "step=4.ckpt"
    folder.mkdir()
    (folder / "empty.pt").write_bytes(b"")  # mmap of an empty file raises ValueError, which no rank may raise alone
    (folder / "short.pt").write_bytes(b"abc")
    entries = {"empty.pt": {"size": 10, "blake2b": "0" * 32}, "short.pt": {"size": 10, "blake2b": "0" * 32}}
    with contextlib.ExitStack() as mappings, pytest.raises(CheckpointIntegrityError) as refused:
        _own_files_verified(folder, entries, mappings)
    assert "empty.pt: expected 10 bytes" in str(refused.value) and "short.pt: expected 10 bytes" in str(refused.value)


def test_a_sibling_with_a_damaged_manifest_is_skipped_when_naming_the_last_good_checkpoint(tmp_path):
    from lightning_hpz.checkpointing.manifest import last_good_checkpoint

    good = _written(tmp_path / "step=2.ckpt", 1)
    for name in _zero_3_names(1):
        (good / name).parent.mkdir(parents=True, exist_ok=True)
        (good / name).write_bytes(b"")
    manifest = json.loads((good / MANIFEST_NAME).read_text())
    manifest["files"] = {name: {"size": 0, "blake2b": "0" * 32} for name in manifest["files"]}
    (good / MANIFEST_NAME).write_text(json.dumps(manifest))
    cut = _written(tmp_path / "step=3.ckpt", 1)
    (cut / MANIFEST_NAME).write_text('{"format": 1, "fi')  # rank 0 alone would raise building the report
    assert last_good_checkpoint(tmp_path / "step=4.ckpt") == good.resolve()


def test_an_error_that_cannot_be_pickled_still_reaches_every_rank():
    from lightning_hpz.checkpointing.rank_agreement import _portable

    class LocalError(Exception):  # a class defined in a function cannot be pickled
        pass

    error = ValueError("plain")
    assert _portable(error) is error
    assert str(_portable(LocalError("no copy"))) == "LocalError: no copy"
