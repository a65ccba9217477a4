"""The ``lightning-hpz`` command: LightningCLI for training plus the package's tools (:mod:`lightning_hpz.cli.main`).

Cheap to import (no torch or Lightning): ``lightning-hpz --help`` answers at once.
"""

from lightning_hpz.cli.main import main

__all__ = ["main"]
