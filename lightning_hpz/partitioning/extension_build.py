"""Build or load one of DeepSpeed's JIT-compiled ops once, announced, and never wait on a lock nobody holds.

DeepSpeed compiles some ops into the torch-extensions cache on first use (minutes on a small machine, nothing
printed). torch guards that build with a ``lock`` file that records no owner; a process killed mid-build leaves it
behind and every later run waits on it forever. Here the op is built or loaded under our own ``flock`` (the kernel
drops it when its holder dies, so it cannot go stale), a ``lock`` whose owner is gone is removed with a message naming
it, and the build is announced and timed. What happens without a C++ compiler is the caller's decision.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# A torch build lock this old, with no process working in the build directory, belongs to a process that is gone.
# (A build that only loads an up-to-date op holds the lock well under a second; a real build has a compiler running.)
STALE_LOCK_AGE_S = 10.0
POLL_S = 1.0
REBUILD_NOTICE_S = 20.0  # loading an up-to-date op takes seconds; a compile takes minutes

Announce = Callable[[str], None]


def build_or_load(
    name: str,
    description: str,
    load: Callable[[], None],
    without_build_tools: Callable[[str], str],
    announce: Announce,
    build_time: str,
) -> str:
    """Load ``name`` (``"loaded"``) or build it (``"built"``); without a compiler: ``without_build_tools(missing)``."""
    directory = build_directory(name)
    with exclusive_lock(directory / "lightning_hpz.flock"):
        wait_for_torch_build_lock(directory / "lock", announce)
        if (directory / f"{name}.so").exists():
            start = time.perf_counter()
            load()  # torch rebuilds here, silently, when DeepSpeed's sources or the build flags changed
            if time.perf_counter() - start > REBUILD_NOTICE_S:
                announce(f"lightning_hpz: rebuilt {name} in {time.perf_counter() - start:.0f} s (sources changed).")
            return "loaded"
        missing = missing_build_tools()
        if missing:
            return without_build_tools(missing)
        announce(
            f"lightning_hpz: building {description} ({name}) once into {directory}; this takes {build_time} on a "
            "small machine, later runs reuse it ..."
        )
        start = time.perf_counter()
        load()
        announce(f"lightning_hpz: built {name} in {time.perf_counter() - start:.0f} s.")
        return "built"


def build_directory(name: str) -> Path:
    """Where torch builds ``name`` (``TORCH_EXTENSIONS_DIR``, else the per-Python/per-accelerator cache)."""
    from torch.utils.cpp_extension import _get_build_directory  # torch internal: the path torch's own load() uses

    return Path(_get_build_directory(name, verbose=False))


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel when this process ends, however it ends
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def wait_for_torch_build_lock(lock: Path, announce: Announce, stale_after_s: float = STALE_LOCK_AGE_S) -> None:
    """Return once torch's build lock is gone: released by a live builder, or removed because its owner is gone."""
    waited_since = time.monotonic()
    announced_wait = False
    while lock.exists():
        if lock_is_stale(lock, stale_after_s):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            announce(
                f"lightning_hpz: removed the stale build lock {lock}: an earlier DeepSpeed build was interrupted "
                "(a killed process), and every run would have waited on it forever."
            )
            return
        if not announced_wait and time.monotonic() - waited_since > stale_after_s:
            announced_wait = True
            announce(
                f"lightning_hpz: waiting for another process building {lock.parent.name} (lock file {lock}; if "
                "no build is running, delete that file) ..."
            )
        time.sleep(POLL_S)


def lock_is_stale(lock: Path, stale_after_s: float = STALE_LOCK_AGE_S) -> bool:
    """Old enough, and no process is working in the build directory (ninja and the compiler run there)."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    return age > stale_after_s and not processes_working_in(lock.parent)


def processes_working_in(directory: Path) -> list[int]:
    """Ids of the processes whose working directory is ``directory`` (Linux /proc; empty where unreadable)."""
    target = directory.resolve()
    working = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if Path(os.readlink(entry / "cwd")) == target:
                working.append(int(entry.name))
    return working


def missing_build_tools() -> str:
    """What torch's JIT build would lack: '' when a C++ compiler and ninja are both on the PATH."""
    compiler = os.environ.get("CXX", "c++")  # the compiler torch's build uses
    missing = [f"the C++ compiler {compiler!r}"] if shutil.which(compiler) is None else []
    if shutil.which("ninja") is None:
        missing.append("ninja")
    return " and ".join(missing)
