"""Import every module of lightning_hpz as the first of the package in a fresh process, as a user's script may.

Heavy third-party packages are imported once up front, Lightning deliberately not: each module is then imported in
a forked child where Lightning is loaded by that module's own imports (the order that once met a circular import).
Prints one JSON line: the modules tried and those that failed, with their errors.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import deepspeed  # noqa: F401 - shared by every child; Lightning is not
import torch._dynamo  # noqa: F401
import torchmetrics  # noqa: F401
import transformers  # noqa: F401

import lightning_hpz

root = Path(lightning_hpz.__file__).parent
# found on disk: pkgutil.walk_packages would import every subpackage (and with it Lightning) in this process
names = sorted(
    ".".join(("lightning_hpz", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
    for path in root.rglob("*.py")
)
assert "lightning.pytorch" not in sys.modules, "Lightning must be loaded by the module under test"
CONCURRENT = os.cpu_count() or 1  # the children only import: one per core


def start(name: str) -> tuple[int, int]:
    """Fork a child that imports ``name``; returns its pid and the read end of its error report."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            __import__(name)
            code = 0
        except BaseException:  # the child reports any failure, whatever its kind
            os.write(write_end, traceback.format_exc()[-1500:].encode())
            code = 1
        os._exit(code)
    os.close(write_end)
    return pid, read_end


failures, running, waiting = {}, {}, list(names)
while waiting or running:
    while waiting and len(running) < CONCURRENT:
        name = waiting.pop(0)
        running[start(name)] = name
    (pid, read_end), name = next(iter(running.items()))
    with os.fdopen(read_end) as report:
        error = report.read()  # until the child exits (its write end closes)
    os.waitpid(pid, 0)
    del running[(pid, read_end)]
    if error:
        failures[name] = error
print(json.dumps({"modules": names, "failures": failures}))
