"""Stabilized hpZ for Lightning Fabric: ``Fabric(strategy="hpz")`` for custom and LitGPT-style training loops."""

from lightning_hpz.fabric.strategy import HpzFabricStrategy, register

__all__ = ["HpzFabricStrategy", "register"]
