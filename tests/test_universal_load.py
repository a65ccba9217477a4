"""A universal load reads each rank's own part of every merged file: the same bytes as DeepSpeed's ZeRO-3
``load_hp_checkpoint_state`` for every shape, padding and rank, from about 1/N of the file's pages instead of all.

No launch: DeepSpeed's function and the replacement are called on one process, with the process group's rank and size
given by a stand-in group (``deepspeed.comm.get_rank(group=...)`` answers from it).
"""

import ctypes
import gc
import mmap
import os
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from lightning_hpz.partitioning import universal_load
from lightning_hpz.partitioning.universal_load import UniversalReads, own_part


@pytest.fixture
def ranks(monkeypatch):
    """``deepspeed.comm``'s rank and size of a stand-in group, which both loaders ask."""
    import deepspeed.comm

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: group.rank)
    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda group=None: group.size)

    def optimizer(rank: int, size: int) -> SimpleNamespace:
        group = SimpleNamespace(rank=rank, size=size)
        return SimpleNamespace(dp_process_group=group, _get_param_partition_group=lambda param: group)

    return optimizer


def _load_both(folder, key, optimizer, param):
    theirs = DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state(optimizer, str(folder), key, param=param)
    reads = UniversalReads()
    ours = universal_load._stage3_own_part(reads)(optimizer, str(folder), key, param=param)
    return theirs, ours, reads


# (shape, ranks): divisible, padded, fewer elements than ranks, a single element, a 3-D tensor
SHAPES = [((64, 32), 4), ((33, 7), 4), ((3,), 8), ((1,), 3), ((5, 6, 7), 6), ((128,), 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "size"), SHAPES)
def test_each_rank_gets_deepspeeds_bytes(ranks, tmp_path, shape, size, dtype):
    whole = torch.randn(shape).to(dtype)
    whole.view(-1)[0] = float("nan")  # a NaN keeps its payload: compared as bytes, not as numbers
    torch.save(whole, tmp_path / "exp_avg.pt")
    copied = 0
    for rank in range(size):
        for param in (None, torch.nn.Parameter(torch.empty(0))):  # DeepSpeed 0.19 passes the parameter
            theirs, ours, reads = _load_both(tmp_path, "exp_avg", ranks(rank, size), param)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert torch.equal(ours.view(torch.uint8), theirs.contiguous().view(torch.uint8))
            assert reads.files_mapped == 1 and reads.files_read_whole == 0
        copied += reads.bytes_copied
    assert copied == whole.numel() * whole.element_size()  # the state once over the ranks, padding not counted


@pytest.mark.parametrize("other", [{}, {"moment": torch.ones(2)}])  # a second tensor: no one record to read from
def test_a_dict_file_reads_its_param_entry(ranks, tmp_path, other):
    from deepspeed.checkpoint.constants import PARAM

    torch.save({PARAM: torch.arange(10.0), "cat_dim": 0, **other}, tmp_path / "fp32.pt")
    theirs, ours, reads = _load_both(tmp_path, "fp32", ranks(2, 3), None)
    assert torch.equal(ours, theirs) and ours.tolist() == [8.0, 9.0, 0.0, 0.0] and reads.bytes_copied == 8


def test_own_part_holds_only_the_elements_in_range():
    part, held = own_part(torch.arange(10.0), 3, 4)  # parts of 3: the last holds element 9 and two zeros
    assert part.tolist() == [9.0, 0.0, 0.0] and held == 1


def test_the_installed_deepspeed_is_one_read_for_this():
    # the guard that keeps an unread DeepSpeed on its own whole-file loader: 0.19.8 must pass it
    assert universal_load.STAGE3_REASON == "" and universal_load.FRAGMENT_REASON == ""
    assert "0.16.9" in universal_load._unread_reason(lambda: None, {"0": "0.16.9"}, "f")


def _resident_fraction(path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` over a fresh shared mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, page = os.path.getsize(path), mmap.PAGESIZE
    pages = (size + page - 1) // page
    with open(path, "rb") as stream:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, stream.fileno(), 0)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0, ctypes.get_errno()
    libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    return sum(byte & 1 for byte in vector) / pages


def _evicted(path) -> float:
    gc.collect()  # a tensor still mapping the file would keep its pages
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return _resident_fraction(path)


def test_one_rank_of_four_reads_a_quarter_of_the_pages(ranks, tmp_path):
    path = tmp_path / "fp32.pt"
    torch.save(torch.randn(16 * 2**20), path)  # 64 MiB
    optimizer, resident = ranks(1, 4), {}
    if _evicted(path) > 0.01:
        pytest.skip("the page cache keeps this file's pages (tmpfs?): nothing to measure")
    for name, load in [
        ("mapped", universal_load._stage3_own_part(UniversalReads())),
        ("deepspeed", DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state),
    ]:
        assert _evicted(path) < 0.01
        part = load(optimizer, str(tmp_path), "fp32", param=None).clone()
        resident[name] = _resident_fraction(path)
        del part
    print(f"resident pages of a 64 MiB file after loading part 1 of 4: {resident}")
    assert resident["deepspeed"] > 0.95
    assert 0.24 < resident["mapped"] < 0.27  # the quarter (and the archive's header and index)


def test_the_load_only_is_patched_and_an_unread_deepspeed_loads_as_shipped(monkeypatch):
    from deepspeed.checkpoint import universal_checkpoint

    stage3 = object.__new__(DeepSpeedZeroOptimizer_Stage3)  # an instance for the dispatch, nothing built
    engine = SimpleNamespace(_config=SimpleNamespace(load_universal_checkpoint=False), optimizer=stage3)
    with universal_load.universal_loading(engine) as reads:
        assert engine._config.load_universal_checkpoint and "load_hp_checkpoint_state" in vars(stage3)
    assert not engine._config.load_universal_checkpoint and "load_hp_checkpoint_state" not in vars(stage3)
    assert reads.fallback == ""

    param = torch.nn.Parameter(torch.zeros(2))
    param.load_hp_checkpoint_state = original = lambda *args, **kwargs: None  # as DeepSpeed binds it on each
    engine.optimizer = SimpleNamespace(bit16_groups=[[param]])
    with universal_load.universal_loading(engine):
        assert param.load_hp_checkpoint_state is not original
        assert isinstance(universal_checkpoint.torch, universal_load._MappingTorch)
    assert param.load_hp_checkpoint_state is original and universal_checkpoint.torch is torch

    monkeypatch.setattr(universal_load, "STAGE3_REASON", "DeepSpeed 0.16.9's `f` is not the one read")
    engine.optimizer = stage3
    with universal_load.universal_loading(engine) as reads:
        assert "load_hp_checkpoint_state" not in vars(stage3)
    assert reads.fallback.startswith("DeepSpeed 0.16.9")
