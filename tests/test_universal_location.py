"""Where a checkpoint's universal-format copy goes: inside it, or in a cache folder when it cannot be written."""

import pytest

from lightning_hpz.checkpointing import universal_location as location
from lightning_hpz.checkpointing.manifest import MANIFEST_NAME, UNIVERSAL_DIR


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "step=4.ckpt"
    folder.mkdir()
    (folder / MANIFEST_NAME).write_text('{"run": {"global_step": 4}}')
    return folder


def test_a_writable_checkpoint_holds_its_own_copy(checkpoint, monkeypatch):
    monkeypatch.delenv(location.CACHE_ENV_VAR, raising=False)
    assert location.universal_location(checkpoint) == checkpoint / UNIVERSAL_DIR
    assert not list(checkpoint.glob(".hpz-write-probe-*"))  # the probe leaves nothing behind


def test_a_read_only_checkpoint_without_a_cache_is_refused_naming_both_fixes(checkpoint, monkeypatch):
    monkeypatch.delenv(location.CACHE_ENV_VAR, raising=False)
    monkeypatch.setattr(location, "is_writable", lambda folder: False)
    with pytest.raises(PermissionError, match="cannot be written") as refused:
        location.universal_location(checkpoint)
    assert location.CACHE_ENV_VAR in str(refused.value) and "lightning-hpz checkpoint convert" in str(refused.value)


def test_a_read_only_checkpoint_uses_the_cache_folder_named_after_its_manifest(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(location, "is_writable", lambda folder: False)
    monkeypatch.setenv(location.CACHE_ENV_VAR, str(tmp_path / "cache"))
    first = location.universal_location(checkpoint)
    assert first.parent == tmp_path / "cache" and first.name.startswith("step=4.ckpt-")
    (checkpoint / MANIFEST_NAME).write_text('{"run": {"global_step": 6}}')  # another checkpoint of the same name
    assert location.universal_location(checkpoint) != first


def test_a_copy_already_inside_is_used_even_with_a_cache(checkpoint, tmp_path):
    (checkpoint / UNIVERSAL_DIR).mkdir()
    assert location.universal_location(checkpoint, cache=tmp_path) == checkpoint / UNIVERSAL_DIR


def test_the_probe_finds_a_folder_that_refuses_files(tmp_path):
    assert location.is_writable(tmp_path)
    assert not location.is_writable(tmp_path / "missing")  # cannot create a file in a folder that is not there
