"""``python -m lightning_hpz.cli``: the same as the ``lightning-hpz`` command."""

from lightning_hpz.cli.main import main

if __name__ == "__main__":
    main()
