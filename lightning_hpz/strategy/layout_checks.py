"""The cluster layout a strategy trains on, and every check of it that can run before a process is launched.

Lightning's connectors configure the launcher (``configure_launcher``) while the Trainer or Fabric is built: here the
hpZ size is resolved against the devices per node, and settings that cannot work on this layout (a size that does
not divide a node, quantized communication without CUDA) are refused with the fix. The one check that needs the
process group (that each secondary group stays inside a node) runs once DeepSpeed's groups exist.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_hpz import collectives
from lightning_hpz.strategy import config as cfg


class LayoutChecks:
    """Mixin of :class:`~lightning_hpz.strategy.hpz_setup.HpzSetup`: devices per node, hpZ size, layout refusals.

    Reads ``zero_settings``, ``config``, ``emulate_async_copy``, ``preset_name`` and ``_autotuner`` (set by
    ``HpzSetup.__init__``) and Lightning's ``parallel_devices``, ``num_nodes`` and ``node_rank``; sets
    ``hpz_partition_size``.
    """

    zero_settings: cfg.ZeroPlusPlusSettings
    config: dict[str, Any]
    hpz_partition_size: Optional[int]

    @property
    def devices_per_node(self) -> int:
        return len(self.parallel_devices or []) or 1

    @property
    def on_cpu(self) -> bool:
        return self._device_type() == "cpu"

    def _device_type(self) -> Optional[str]:
        # The Trainer and Fabric have distinct accelerator classes; the devices they hand the strategy say the same.
        devices = self.parallel_devices
        return devices[0].type if devices else None

    def configure_launcher(self) -> None:
        # Called while the Trainer or Fabric is built, before any process is launched: the place for every layout check.
        self._resolve_layout()
        super().configure_launcher()

    def _resolve_layout(self) -> None:
        settings = self.zero_settings
        size, how = cfg.resolve_partition_size(
            settings.hpz_partition_size, settings.stage, self.devices_per_node, self.num_nodes
        )
        cfg.validate_layout(size, self.devices_per_node, self.num_nodes)
        self._refuse_quantization_without_cuda()
        self._refuse_qwz_on_bf16_where_broken()
        self._refuse_qgz_groups_across_nodes()
        if self.emulate_async_copy and not self.on_cpu:
            raise cfg.HpzConfigurationError(
                "emulate_async_copy=True reproduces the hpZ race on CPU; on a GPU the copies really are asynchronous. "
                "Use accelerator='cpu', or unset LIGHTNING_HPZ_EMULATE_ASYNC_COPY."
            )
        self.hpz_partition_size = size
        cfg.validate_hpz_companions(self.config, size)
        if settings.stage:  # stage 0 (zero_optimization=False) keeps ZeRO off, as in Lightning
            self.config.setdefault("zero_optimization", {}).update(cfg.zero_section(settings, size))
        if self._autotuner is not None and self._autotuner.fixed.hpz_partition_size is None:
            rank_zero_info("hpZ partition size: chosen by the autotuner once the processes are up (autotune=True).")
        elif settings.hpz_partition_size == "auto":
            rank_zero_info(how)

    def _refuse_quantization_without_cuda(self) -> None:
        if self._device_type() in (None, "cuda"):
            return
        if self.preset_name == "zeropp":
            raise cfg.HpzConfigurationError(
                "strategy='zeropp' (full ZeRO++: hpZ + qwZ + qgZ) needs CUDA: DeepSpeed has no "
                f"{type(self.accelerator).__name__} kernels for its quantized communication. Use strategy='hpz' "
                "(ZeRO-3 + hpZ, no quantization) here, or train on GPUs."
            )
        for name in ("quantized_weights", "quantized_gradients"):
            if getattr(self.zero_settings, name):
                raise cfg.HpzConfigurationError(
                    f"{name}=True (ZeRO++ {'qwZ' if name == 'quantized_weights' else 'qgZ'}) needs CUDA: DeepSpeed has "
                    f"no {type(self.accelerator).__name__} kernels for it. Set {name}=False, or train on GPUs."
                )

    def _refuse_qwz_on_bf16_where_broken(self) -> None:
        if not self.zero_settings.quantized_weights:
            return
        from importlib.metadata import version

        plugin = getattr(self, "precision_plugin", None) or getattr(self, "precision", None)  # Trainer or Fabric
        bf16 = str(getattr(plugin, "precision", "")).startswith("bf16")
        bf16 = bf16 or bool((self.config.get("bf16") or {}).get("enabled"))
        cfg.validate_qwz_precision(True, bf16, version("deepspeed"))

    def _refuse_qgz_groups_across_nodes(self) -> None:
        # DeepSpeed sizes qgZ's node-local groups by the GPUs a process sees (`get_accelerator().device_count()`,
        # deepspeed/utils/groups.py, `_get_local_all_to_all_group`), not by the devices per node this run uses.
        if not self.zero_settings.quantized_gradients or self._device_type() != "cuda":
            return
        import torch

        cfg.validate_qgz_groups(torch.cuda.device_count(), self.devices_per_node)

    def _check_secondary_groups_within_nodes(self) -> None:
        """DeepSpeed groups consecutive global ranks; make sure the launcher numbered each node's ranks together."""
        size = self.hpz_partition_size or 1
        if size <= 1:
            return
        node_of_rank = collectives.all_gather_object(self.node_rank)
        for start in range(0, len(node_of_rank), size):
            nodes = set(node_of_rank[start : start + size])
            if len(nodes) > 1:
                raise cfg.HpzConfigurationError(
                    f"hpZ secondary group of ranks {start}..{start + size - 1} spans nodes {sorted(nodes)}: the "
                    "launcher did not number each node's ranks consecutively, so backward gathers would cross nodes. "
                    "Launch with ranks grouped by node (torchrun and SLURM do), or set hpz_partition_size=1."
                )
