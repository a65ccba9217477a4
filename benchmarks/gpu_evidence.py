"""What a GPU user pays or gains with lightning_hpz, measured on one GPU: one command, JSON plus markdown tables.

    python benchmarks/gpu_evidence.py --out results/gpu_evidence      # on a GPU machine: about 8 minutes
    python benchmarks/gpu_evidence.py --tiny --out /tmp/gpu_evidence  # the same code paths on CPU, in about a minute
    python benchmarks/gpu_evidence.py --prepare-wheels .whl           # here: wheels a bare GPU image lacks

Parts (``--parts``, in this order; each part's record is written to ``results.json`` as soon as it ends, so a run
stopped at its time limit keeps what it measured; ``--budget`` skips the parts that no longer fit):

* ``throughput``: a Llama-2-architecture model of 1.1B parameters (TinyLlama's shape: GQA, 22 layers), bf16,
  sequence 2048, ``--steps`` measured steps after ``--warmup``, under DeepSpeed's own engine in a hand-written loop
  (the reference: the same DeepSpeed config as the strategy's), ``HpzStrategy`` ZeRO-3 in a Trainer, Lightning's
  FSDP2 (``ModelParallelStrategy``) and DDP. Each configuration runs in its own process (clean CUDA state); the
  micro-batch is the largest that fits DeepSpeed's engine (probed downward on out-of-memory), and the others run at
  that size or, if it does not fit them, the largest below it. Tokens/s, MFU (``model_flops`` and ``peak_flops``
  of this package), peak memory, each against DeepSpeed's engine.
* ``sync_cost``: the race fix's price in one process: at the 1B model's real parameter sizes, each parameter's
  secondary shard (hpZ 2) is copied on the compute stream after its layer's forward matmuls, and read back by a
  gather stand-in on a real side stream during backward (one layer of prefetch), ordered by
  :class:`~lightning_hpz.partitioning.CopyOrdering` under ``none``, ``event`` and ``stream``. Step time per mode,
  and host time split into copy, wait and gather.
* ``sync_phases``: ``benchmarks/hpz_sync_modes.py`` with four ranks and hpZ 2 (all on one GPU over gloo when the
  machine has fewer than four), ``none``/``event``/``stream``, each step split into copy, wait and gather time.
* ``trainer_stages``: ``fit`` and then ``validate`` and ``test`` on the same module and Trainer (Lightning's
  teardown moves the module to the CPU in between), with all four callbacks of the package; the non-logging steps
  of ``fit`` run under ``torch.cuda.set_sync_debug_mode("warn")``, and every host sync is charged to the code that
  asked for it (``"error"`` would stop at the first one, which may be DeepSpeed's own).
* ``nccl_sync_modes``: ``hpz_sync_modes.py`` under NCCL where it can run: one rank per GPU (with one GPU, a world of
  one: DeepSpeed alone against hpZ 1 ``event``, bit for bit).

``--tiny`` runs every part on CPU processes over gloo with a tiny model and 2-3 steps; parts that need CUDA record
``"skipped"`` with the reason. On a GPU machine ``--out $OUT`` keeps the returned files to ``results.json`` and
``results.md`` (scratch files go to a temporary folder).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
PARTS = ("throughput", "sync_cost", "sync_phases", "trainer_stages", "nccl_sync_modes")
THROUGHPUT_CONFIGURATIONS = ("deepspeed", "hpz", "fsdp2", "ddp")  # the first is the reference
MODES = ("none", "event", "stream")
OOM_EXIT = 3
LR = 1e-4
PHASES = ("copy", "copy_sync", "wait", "gather")  # host time of sync_cost's step, by phase
HPZ = 2  # the secondary partition's size in sync_cost: each rank's secondary holds 1/HPZ of a parameter
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
# what a bare GPU image lacks for this repository (versions: those installed where the wheels are prepared)
CARRIED_PACKAGES = ("deepspeed", "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                    "lightning")  # fmt: skip

# Llama-2 architecture (RMSNorm, SwiGLU, rotary, GQA as in Llama-2 70B) at TinyLlama-1.1B's shape
LLAMA2_1B = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    use_cache=False,
)  # fmt: skip
# the stages check: big enough for real kernels, small enough to cost seconds
LLAMA2_SMALL = dict(LLAMA2_1B, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2)  # fmt: skip
LLAMA2_TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   use_cache=False)  # fmt: skip


@dataclass(frozen=True)
class Scale:
    """What one run measures: the model, its sequence, the micro-batches tried (largest first) and the steps."""

    model: dict = field(default_factory=lambda: dict(LLAMA2_1B))
    seq: int = 2048
    micro_batches: tuple[int, ...] = (32, 16, 8, 4, 2, 1)
    warmup: int = 3
    steps: int = 30
    sync_steps: int = 10  # measured steps per mode in sync_cost
    stages_model: dict = field(default_factory=lambda: dict(LLAMA2_SMALL))
    stages_seq: int = 512
    ranks_steps: int = 12  # hpz_sync_modes steps (four ranks)
    ranks_width: int = 1024  # hpz_sync_modes layer width: as gpu_acceptance's hpz_ranks, where 1.53x was seen
    nccl_steps: int = 8
    worker_timeout: float = 240
    tiny: bool = False


GPU = Scale()
TINY = Scale(model=LLAMA2_TINY, seq=64, micro_batches=(4, 2), warmup=1, steps=2, sync_steps=2,
             stages_model=LLAMA2_TINY, stages_seq=64, ranks_steps=2, ranks_width=64, nccl_steps=2,
             worker_timeout=180, tiny=True)  # fmt: skip


# ----------------------------------------------------------------------------------------------- shared pieces
def compute_device(scale: Scale) -> Any:
    return torch.device("cpu") if scale.tiny else torch.device("cuda", 0)


def model_shape(settings: dict) -> Any:
    from lightning_hpz.callbacks.model_flops import shape_from_config

    return shape_from_config({**settings, "model_type": "llama"})


def parameter_count(settings: dict) -> int:
    shape = model_shape(settings)
    per_layer = shape.self_attention_weights() + shape.mlp_weights() + 2 * shape.hidden  # two RMSNorms
    return shape.layers * per_layer + 2 * shape.vocab * shape.hidden + shape.hidden  # embedding, head, final norm


def micro_batch_guess(scale: Scale, memory_bytes: float) -> int:
    """The largest candidate a rough estimate lets fit: 20 bytes a parameter (bf16 weights and gradients, fp32
    master, fp32 gradients, Adam's two moments) plus activations without checkpointing (bf16 saved tensors and the
    fp32 norms of each layer, the logits in bf16 and fp32 for the loss). The probe corrects a wrong guess."""
    shape = model_shape(scale.model)
    per_token = shape.layers * (32 * shape.hidden + 8 * shape.ffn) + 16 * shape.vocab
    states = 20 * parameter_count(scale.model)
    fitting = [b for b in scale.micro_batches if states + b * scale.seq * per_token <= memory_bytes]
    return fitting[0] if fitting else scale.micro_batches[-1]


def token_batches(settings: dict, seq: int, micro_batch: int, count: int, seed: int = 0) -> Any:
    """``count`` micro-batches of random token ids (the same for every configuration)."""
    from torch.utils.data import DataLoader

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, settings["vocab_size"], (count * micro_batch, seq), generator=generator)
    return DataLoader(tokens, batch_size=micro_batch, pin_memory=torch.cuda.is_available())


def build_llama(settings: dict) -> Any:
    from lightning_hpz.models.architectures import build_hf_model, hf_config

    return build_hf_model("llama2", hf_config("llama2", settings))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_rank_environment() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


class Measurement:
    """Step ends as CUDA events (no host sync until :meth:`record`), losses kept on the device, peak memory."""

    def __init__(self, scale: Scale, micro_batch: int, device: Any) -> None:
        from lightning_hpz.callbacks.step_clock import StepClock

        self.scale, self.micro_batch, self.device = scale, micro_batch, device
        self.clock = StepClock(device)
        self.losses: list[Any] = []
        self.steps_done = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def after_step(self, loss: Any) -> None:
        self.losses.append(loss.detach().float())
        self.steps_done += 1
        if self.steps_done == self.scale.warmup:
            self.clock.start()
        elif self.steps_done > self.scale.warmup:
            self.clock.mark()

    def record(self) -> dict:
        from lightning_hpz.callbacks.model_flops import training_flops_per_token
        from lightning_hpz.callbacks.peak_flops import peak_flops_for
        from lightning_hpz.process_memory import max_rss_bytes

        since_start = self.clock.read()
        step_times = [b - a for a, b in zip([0.0, *since_start], since_start, strict=False)]
        tokens = self.micro_batch * self.scale.seq
        tokens_per_s = len(step_times) * tokens / since_start[-1]
        flops_per_token = training_flops_per_token(model_shape(self.scale.model), self.scale.seq)
        peak = peak_flops_for(self.device, torch.bfloat16)
        on_cuda = self.device.type == "cuda"
        return {
            "device": torch.cuda.get_device_name(self.device) if on_cuda else "cpu",
            "micro_batch": self.micro_batch,
            "seq": self.scale.seq,
            "parameters": parameter_count(self.scale.model),
            "warmup_steps": self.scale.warmup,
            "measured_steps": len(step_times),
            "step_times": step_times,
            "median_step_s": statistics.median(step_times),
            "tokens_per_s": tokens_per_s,
            "flops_per_token": flops_per_token,
            "peak_flops": peak,
            "mfu": None if peak is None else tokens_per_s * flops_per_token / peak,
            "peak_memory_gib": (torch.cuda.max_memory_allocated(self.device) if on_cuda else max_rss_bytes()) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(self.device) / 2**30 if on_cuda else None,
            "losses": torch.stack(self.losses).tolist(),
        }


# ----------------------------------------------------------------------------------------------- throughput
def deepspeed_config(micro_batch: int) -> dict:
    """The DeepSpeed config HpzStrategy(stage=3) runs one GPU with (its defaults, hpZ resolved to 1, bf16)."""
    import lightning_hpz

    config = copy.deepcopy(lightning_hpz.HpzStrategy(stage=3).config)
    zero = dict(zero_hpz_partition_size=1, zero_quantized_weights=False, zero_quantized_gradients=False)
    config["zero_optimization"].update(zero)
    config.update(bf16={"enabled": True}, gradient_clipping=0.0, train_micro_batch_size_per_gpu=micro_batch,
                  gradient_accumulation_steps=1)  # fmt: skip
    return config


def deepspeed_loop(scale: Scale, micro_batch: int) -> dict:
    """DeepSpeed's own engine in a hand-written loop: the reference."""
    import deepspeed

    device = compute_device(scale)
    one_rank_environment()
    if device.type == "cpu":  # DeepSpeed's CPU accelerator would ask for its own backend (ccl)
        torch.distributed.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config = deepspeed_config(micro_batch)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_llama(scale.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    measurement = Measurement(scale, micro_batch, device)
    for batch in token_batches(scale.model, scale.seq, micro_batch, scale.warmup + scale.steps):
        batch = batch.to(device, non_blocking=True)
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        measurement.after_step(loss)
    return {**measurement.record(), "config": _compared_config(config)}


def _compared_config(config: dict) -> dict:
    return {key: config.get(key) for key in ("zero_optimization", "bf16", "fp16", "gradient_clipping")}


def causal_lm_module(settings: dict, shard_with_fsdp2: bool = False) -> Any:
    import lightning as L

    class CausalLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Optional[torch.nn.Module] = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            if not shard_with_fsdp2:  # the strategy's own context places (or partitions) it
                self.model = build_llama(settings)
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            with self.trainer.strategy.root_device:  # Lightning's ModelParallelStrategy would build it on the CPU
                self.model = build_llama(settings)
            # bf16 compute, fp32 weights, gradients and optimizer: what DeepSpeed's bf16 mode keeps
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

        def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.log("test_loss", self.model(input_ids=batch, labels=batch).loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return CausalLM()


def measuring_callback(measurement: Measurement) -> Any:
    import lightning as L

    class Measured(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            measurement.after_step(outputs["loss"])

    return Measured()


def quiet_trainer(scale: Scale, strategy: Any, precision: str, max_steps: int, callbacks: list, **kwargs: Any) -> Any:
    import lightning as L

    return L.Trainer(
        accelerator=compute_device(scale).type, devices=1, strategy=strategy, precision=precision,
        max_steps=max_steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def trainer_throughput(name: str, scale: Scale, micro_batch: int) -> dict:
    """HpzStrategy ZeRO-3, Lightning's FSDP2 or DDP in a Trainer, measured like the reference loop."""
    import lightning_hpz

    if name == "hpz":
        strategy, precision = lightning_hpz.HpzStrategy(stage=3), "bf16-mixed"
    elif name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, precision = ModelParallelStrategy(), "32-true"  # bf16 compute through FSDP2's policy
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strategy, precision = DDPStrategy(), "bf16-mixed"
    measurement = Measurement(scale, micro_batch, compute_device(scale))
    trainer = quiet_trainer(scale, strategy, precision, scale.warmup + scale.steps, [measuring_callback(measurement)])
    torch.manual_seed(0)
    trainer.fit(
        causal_lm_module(scale.model, name == "fsdp2"),
        token_batches(scale.model, scale.seq, micro_batch, scale.warmup + scale.steps),
    )
    record = measurement.record()
    if name == "hpz":
        record["config"] = _compared_config(trainer.strategy.config)
    return record


def throughput_worker(options: dict, scale: Scale) -> dict:
    name, micro_batch = options["configuration"], options["micro_batch"]
    if name == "deepspeed":
        return deepspeed_loop(scale, micro_batch)
    return trainer_throughput(name, scale, micro_batch)


def measure_throughput(scale: Scale, work: Path, deadline: float) -> dict:
    """Each configuration in its own process, from the largest micro-batch that may fit down to one that does."""
    memory = math.inf if scale.tiny else gpu_facts()["memory_bytes"]
    start = micro_batch_guess(scale, memory)
    candidates = [b for b in scale.micro_batches if b <= start]
    results: dict[str, dict] = {}
    for name in THROUGHPUT_CONFIGURATIONS:
        record: dict = {"error": "no micro-batch tried"}
        out_of_memory = []
        for micro_batch in candidates:
            if time.monotonic() > deadline:
                record = {"error": "skipped: the time budget was spent"}
                break
            record = run_worker({"part": "throughput", "configuration": name, "micro_batch": micro_batch}, scale, work)
            if not record.get("oom"):
                break
            out_of_memory.append(micro_batch)
        results[name] = {**record, "out_of_memory_at": out_of_memory}
        if name == "deepspeed" and "micro_batch" in record:
            candidates = [b for b in candidates if b <= record["micro_batch"]]
    return {"configurations": add_ratios(results), "table": throughput_table(results)}


def add_ratios(results: dict[str, dict]) -> dict[str, dict]:
    reference = results.get("deepspeed", {})
    for record in results.values():
        if "tokens_per_s" in record and "tokens_per_s" in reference:
            record["tokens_per_s_vs_deepspeed"] = record["tokens_per_s"] / reference["tokens_per_s"]
            record["peak_memory_vs_deepspeed"] = record["peak_memory_gib"] / reference["peak_memory_gib"]
            record["extra_ms_per_step_vs_deepspeed"] = 1e3 * (record["median_step_s"] - reference["median_step_s"])
            record["same_micro_batch_as_deepspeed"] = record["micro_batch"] == reference["micro_batch"]
    if "config" in results.get("hpz", {}) and "config" in reference:
        results["hpz"]["same_config_as_deepspeed"] = results["hpz"]["config"] == reference["config"]
    return results


def throughput_table(results: dict[str, dict]) -> str:
    header = ["configuration", "micro-batch", "tokens/s", "MFU", "median step (s)", "peak memory (GiB)",
              "tokens/s vs DeepSpeed", "memory vs DeepSpeed"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    names = {"deepspeed": "DeepSpeed engine, own loop", "hpz": "HpzStrategy ZeRO-3, Trainer",
             "fsdp2": "FSDP2 (ModelParallelStrategy), Trainer", "ddp": "DDP, Trainer"}  # fmt: skip
    for name, record in results.items():
        if "tokens_per_s" not in record:
            reason = "out of memory at every micro-batch tried" if record.get("oom") else record.get("error", "")
            lines.append(f"| {names[name]} | {reason} |" + " |" * (len(header) - 2))
            continue
        mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
        lines.append(
            f"| {names[name]} | {record['micro_batch']} | {record['tokens_per_s']:.0f} | {mfu} | "
            f"{record['median_step_s']:.4f} | {record['peak_memory_gib']:.2f} | "
            f"{record.get('tokens_per_s_vs_deepspeed', math.nan):.3f} | "
            f"{record.get('peak_memory_vs_deepspeed', math.nan):.2f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- sync cost
def parameter_shapes(settings: dict) -> list[list[tuple[int, ...]]]:
    """Each layer's parameter shapes in forward order: embedding, the decoder layers, final norm and head."""
    shape = model_shape(settings)
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    layer = [(h,), (h, h), (kv, h), (kv, h), (h, h), (h,), (shape.ffn, h), (shape.ffn, h), (h, shape.ffn)]
    return [[(shape.vocab, h)], *[layer] * shape.layers, [(h,), (shape.vocab, h)]]


class PhaseClock:
    """Host seconds spent in each named phase (summed per step)."""

    def __init__(self) -> None:
        self.seconds: Counter = Counter()

    def timed(self, phase: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds[phase] += time.perf_counter() - start


class CopyThenGather:
    """The hpZ pattern of one step: forward matmuls of each layer, then the secondary copies of its parameters on
    the compute stream; in backward, each layer's secondaries gathered on a side stream one layer ahead, the compute
    stream waiting for that gather before the layer's two backward matmuls."""

    def __init__(self, scale: Scale, mode: str, tokens: int) -> None:
        from lightning_hpz.partitioning import CopyOrdering

        self.device = compute_device(scale)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda:
            from deepspeed.accelerator import get_accelerator

            self.accelerator = get_accelerator()
        else:
            from lightning_hpz.partitioning.emulation import EmulatedAsyncDevice

            self.accelerator = EmulatedAsyncDevice()  # copies land only when ordered: the plumbing of each mode
        self.ordering = CopyOrdering(mode, self.accelerator)
        dtype = torch.bfloat16
        # scaled by fan-in, so that activations stay finite through the layers' matmuls
        self.layers = [[torch.randn(s, device=self.device, dtype=dtype) * s[-1] ** -0.5 for s in layer]
                       for layer in parameter_shapes(scale.model)]  # fmt: skip
        widest = max(max(p.shape) for layer in self.layers for p in layer)
        self.activations = torch.randn(tokens, widest, device=self.device, dtype=dtype)
        self.side = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.phases = PhaseClock()

    def _compute(self, layer: list[Any], passes: int) -> None:
        for weight in layer:
            if weight.dim() == 2:
                for _ in range(passes):
                    self.activations[:, : weight.shape[0]].copy_(self.activations[:, : weight.shape[1]] @ weight.t())

    def _release(self, layer: list[Any]) -> list[Any]:
        secondaries = []
        for weight in layer:
            shard = weight.view(-1)[: weight.numel() // HPZ]
            secondary = torch.empty_like(shard)
            self.phases.timed("copy", secondary.copy_, shard)
            if not self.on_cuda:
                self.accelerator.defer_copy(secondary)
            self.phases.timed("copy_sync", self.ordering.after_secondary_copy, secondary)
            secondaries.append(secondary)
        return secondaries

    def _gather(self, secondaries: list[Any]) -> Any:
        """On the side stream: the ordering's wait, then every secondary read into a full-size buffer."""
        with torch.cuda.stream(self.side) if self.on_cuda else nullcontext():
            self.phases.timed("wait", self.ordering.before_secondary_gather, secondaries)
            start = time.perf_counter()
            for secondary in secondaries:
                torch.empty(HPZ, secondary.numel(), device=self.device, dtype=secondary.dtype).copy_(
                    secondary.expand(HPZ, -1)
                )
            self.phases.seconds["gather"] += time.perf_counter() - start
            done = torch.cuda.Event() if self.on_cuda else None
            if done is not None:
                done.record()
        return done

    def step(self) -> None:
        secondaries = []
        for index, layer in enumerate(self.layers):
            if index:  # the embedding is a lookup, not a matmul
                self._compute(layer, passes=1)
            secondaries.append(self._release(layer))
        gathered = self._gather(secondaries[-1])
        for index in reversed(range(len(self.layers))):
            ahead = self._gather(secondaries[index - 1]) if index else None
            if gathered is not None:
                torch.cuda.current_stream().wait_event(gathered)
            if index:
                self._compute(self.layers[index], passes=2)
            gathered = ahead


def time_sync_mode(scale: Scale, mode: str, tokens: int) -> dict:
    pattern = CopyThenGather(scale, mode, tokens)
    wall, per_step_phases = [], []
    for step in range(scale.warmup + scale.sync_steps):
        if pattern.on_cuda:
            torch.cuda.synchronize()
        pattern.phases.seconds.clear()
        start = time.perf_counter()
        pattern.step()
        if pattern.on_cuda:
            torch.cuda.synchronize()
        if step >= scale.warmup:
            wall.append(time.perf_counter() - start)
            per_step_phases.append(dict(pattern.phases.seconds))
    steps = len(wall)
    return {
        "median_step_s": statistics.median(wall),
        "step_times": wall,
        "host_seconds_per_step": {p: statistics.median(s.get(p, 0.0) for s in per_step_phases) for p in PHASES},
        "host_syncs_per_step": pattern.ordering.host_syncs / (scale.warmup + steps),
        "events_recorded_per_step": pattern.ordering.events_recorded / (scale.warmup + steps),
        "secondary_copies_per_step": sum(len(layer) for layer in pattern.layers),
        "secondary_bytes_per_step": sum(p.numel() // HPZ for layer in pattern.layers for p in layer) * 2,
    }


def sync_cost_worker(options: dict, scale: Scale) -> dict:
    tokens = options["tokens"]
    modes = {mode: time_sync_mode(scale, mode, tokens) for mode in MODES}
    none, event, stream = (modes[m]["median_step_s"] for m in MODES)
    return {
        "device": torch.cuda.get_device_name(0) if not scale.tiny else "cpu (emulated asynchronous copies)",
        "tokens": tokens,
        "hpz_partition_size": HPZ,
        "modes": modes,
        "event_vs_none": event / none,
        "stream_vs_none": stream / none,
        "event_vs_stream": event / stream,
        "event_within_2pct_of_none": event <= 1.02 * none,
        "event_faster_than_stream": event < stream,
    }


def sync_cost_table(record: dict) -> str:
    header = ["mode", "median step (s)", "vs none", *(f"host {phase} (s)" for phase in PHASES), "host syncs/step"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    none = record["modes"]["none"]["median_step_s"]
    for mode, r in record["modes"].items():
        host = " | ".join(f"{r['host_seconds_per_step'][phase]:.4f}" for phase in PHASES)
        lines.append(f"| {mode} | {r['median_step_s']:.4f} | {r['median_step_s'] / none:.3f} | {host} | "
                     f"{r['host_syncs_per_step']:.0f} |")  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- several ranks
def run_sync_modes(scale: Scale, work: Path, name: str, arguments: list[str], timeout: float) -> dict:
    """benchmarks/hpz_sync_modes.py as a user runs it; its results.json."""
    out = work / name
    command = [sys.executable, str(BENCHMARKS / "hpz_sync_modes.py"), *arguments, "--out", str(out)]
    command += ["--device", "cpu"] if scale.tiny else ["--bf16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=worker_environment(), cwd=REPO)
    if done.returncode != 0 or not (out / "results.json").is_file():
        return {"error": f"exit code {done.returncode}", "output": (done.stdout + done.stderr)[-3000:]}
    return {"configurations": json.loads((out / "results.json").read_text()), "table": (out / "results.md").read_text()}


def sync_phases(scale: Scale, work: Path) -> dict:
    arguments = ["--ranks", "4", "--steps", str(scale.ranks_steps), "--width", str(scale.ranks_width),
                 "--validate-every", "0" if scale.tiny else "5",
                 "--job-timeout", str(scale.worker_timeout)]  # fmt: skip
    configurations = "hpz2-event" if scale.tiny else "hpz2-none,hpz2-event,hpz2-stream"  # tiny: the plumbing once
    record = run_sync_modes(scale, work, "sync_phases", [*arguments, "--configurations", configurations],
                            timeout=4 * scale.worker_timeout)  # fmt: skip
    if "configurations" in record:
        record["phase_table"] = phase_table(record["configurations"])
    return record


def phase_table(configurations: dict[str, dict]) -> str:
    lines = ["| configuration | median step (s) | copy (s) | of which sync (s) | wait, host (s) | wait, device (s) "
             "| gather issue (s) | gather wait (s) |", "|" + " --- |" * 8]  # fmt: skip
    for name, record in configurations.items():
        if "phases" not in record:
            lines.append(f"| {name} | {record.get('error', 'no phases recorded')} |" + " |" * 6)
            continue
        settled = record["phases"][min(5, len(record["phases"]) // 5) :] or record["phases"]
        cells = [statistics.median(step[p] for step in settled) for p in
                 ("step", "copy", "copy_sync", "wait", "wait_device", "gather_issue", "gather_wait")]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(f"{value:.4f}" for value in cells) + " |")
    return "\n".join(lines)


def nccl_sync_modes(scale: Scale, work: Path) -> dict:
    ranks = 1 if scale.tiny else (4 if torch.cuda.device_count() >= 4 else 1)
    configurations = "zero3-stock,hpz1-event" + (",hpz2-event,hpz2-stream" if ranks >= 4 else "")
    arguments = ["--ranks", str(ranks), "--steps", str(scale.nccl_steps), "--width", str(scale.ranks_width),
                 "--validate-every", "0" if scale.tiny else "4", "--configurations", configurations,
                 "--job-timeout", str(scale.worker_timeout)]  # fmt: skip
    record = run_sync_modes(scale, work, "nccl_sync_modes", arguments, timeout=4 * scale.worker_timeout)
    if "configurations" in record:
        runs = record["configurations"]
        from hpz_sync_modes import same_numbers

        record["ranks"] = ranks
        record["bit_identical_to_deepspeed"] = {name: same_numbers(r, runs["zero3-stock"]) for name, r in runs.items()}
    return record


# ----------------------------------------------------------------------------------------------- trainer stages
def package_frame(stack: list[Any]) -> tuple[str, str]:
    """Who asked for a sync: the innermost frame outside torch and this script, as (owner, 'file:line')."""

    torch_dir, here = str(Path(torch.__file__).parent), str(Path(__file__).resolve())
    owners = (("lightning_hpz", "lightning_hpz"), ("deepspeed", "deepspeed"), ("lightning", "lightning"),
              ("transformers", "transformers"))  # fmt: skip
    for frame in reversed(stack):
        if frame.filename.startswith(torch_dir) or frame.filename == here or "warnings" in frame.filename:
            continue
        owner = next((name for marker, name in owners if f"/{marker}/" in frame.filename), "other")
        return owner, f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "torch", "torch"


def sync_audit_callback(log_every: int) -> Any:
    """Non-logging steps of fit under ``set_sync_debug_mode("warn")``; each sync charged to who asked for it."""
    import traceback as tb

    import lightning as L

    class SyncAudit(L.Callback):
        def __init__(self) -> None:
            self.syncs: Counter = Counter()
            self.audited_batches: list[int] = []
            self._warnings: Optional[warnings.catch_warnings] = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step + 1  # the optimizer step this batch ends in
            if step % log_every and step > 1 and torch.cuda.is_available():
                self.audited_batches.append(batch_idx)
                self._warnings = warnings.catch_warnings()  # filters and showwarning come back as they were
                self._warnings.__enter__()
                warnings.simplefilter("always")
                warnings.showwarning = self._charge
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self._warnings is not None:
                torch.cuda.set_sync_debug_mode(0)
                self._warnings.__exit__(None, None, None)
                self._warnings = None

        def _charge(self, message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "synchronizing" in str(message):
                owner, where = package_frame(tb.extract_stack())
                self.syncs[f"{owner}: {where}"] += 1

    return SyncAudit()


def trainer_stages_worker(options: dict, scale: Scale) -> dict:
    """fit with the four callbacks (the non-logging steps audited), then validate and test on the same module."""
    import lightning_hpz
    from lightning_hpz.callbacks import LossStabilityMonitor, SecondaryPartitionCheck, TokenThroughputMonitor

    log_every, steps = 4, 12
    settings = {**scale.stages_model, "model_type": "llama"}
    audit = sync_audit_callback(log_every)
    callbacks = [
        audit, TokenThroughputMonitor(model_config=settings, window_size=2),
        LossStabilityMonitor(warmup=2, dirpath=options["work"]), SecondaryPartitionCheck(every_n_steps=1000),
    ]  # fmt: skip
    trainer = quiet_trainer(scale, lightning_hpz.HpzStrategy(stage=3), "bf16-mixed", steps, callbacks,
                            log_every_n_steps=log_every)  # fmt: skip
    module = causal_lm_module(scale.stages_model)
    data = token_batches(scale.stages_model, scale.stages_seq, 2, steps)
    torch.manual_seed(0)
    trainer.fit(module, data)
    devices = {"after_fit": str(next(module.parameters()).device)}
    validated = trainer.validate(module, token_batches(scale.stages_model, scale.stages_seq, 2, 2, seed=1))
    devices["after_validate"] = str(next(module.parameters()).device)
    tested = trainer.test(module, token_batches(scale.stages_model, scale.stages_seq, 2, 2, seed=2))
    package_syncs = {where: n for where, n in audit.syncs.items() if where.startswith("lightning_hpz")}
    audited = bool(audit.audited_batches)
    return {
        "global_step": trainer.global_step,
        "val_loss": validated[0]["val_loss"],
        "test_loss": tested[0]["test_loss"],
        "module_device": devices,
        "callbacks": sorted(type(c).__name__ for c in trainer.callbacks),
        "sync_audit": {
            "audited_batches": audit.audited_batches,
            "syncs_by_caller": dict(audit.syncs),
            "package_syncs": package_syncs,
            "no_package_sync": not package_syncs if audited else None,
        }
        if audited
        else {"skipped": "needs CUDA (torch.cuda.set_sync_debug_mode)"},
    }


# ----------------------------------------------------------------------------------------------- processes
WORKERS: dict[str, Callable[[dict, Scale], dict]] = {
    "throughput": throughput_worker,
    "sync_cost": sync_cost_worker,
    "trainer_stages": trainer_stages_worker,
}


def worker_environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the same for every configuration
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_worker(options: dict, scale: Scale, work: Path) -> dict:
    """One measurement in a fresh process; its record, ``{"oom": True}``, or its error and the end of its output."""
    record_path = work / f"{options['part']}-{options.get('configuration', '')}-{options.get('micro_batch', '')}.json"
    options = {**options, "record": str(record_path), "tiny": scale.tiny, "work": str(work)}
    command = [sys.executable, __file__, "--worker", json.dumps(options)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=scale.worker_timeout,
                              env=worker_environment(), cwd=work, start_new_session=True)  # fmt: skip
    except subprocess.TimeoutExpired as err:
        return {"error": f"timed out after {scale.worker_timeout} s", "output": str(err.output or "")[-2000:]}
    output = done.stdout + done.stderr
    # a strategy may end the process its own way on an error: the allocator's message then says what it was
    if done.returncode == OOM_EXIT or (done.returncode != 0 and "CUDA out of memory" in output):
        return {"oom": True}
    if done.returncode != 0 or not record_path.is_file():
        return {"error": f"exit code {done.returncode}", "output": output[-3000:]}
    return json.loads(record_path.read_text())


def worker_main(options: dict) -> int:
    scale = TINY if options["tiny"] else GPU
    if not scale.tiny:
        torch.cuda.set_device(0)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        record = WORKERS[options["part"]](options, scale)
    except Exception as err:
        if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
            return OOM_EXIT
        raise
    Path(options["record"]).write_text(json.dumps(record))
    return 0


# ----------------------------------------------------------------------------------------------- driver
def run_part(name: str, scale: Scale, work: Path, deadline: float) -> dict:
    start = time.monotonic()
    if not scale.tiny and not torch.cuda.is_available():
        return {"skipped": "no CUDA device (use --tiny on a CPU)"}
    if start > deadline:
        return {"skipped": "the time budget was spent"}
    try:
        if name == "throughput":
            record = measure_throughput(scale, work, deadline)
        elif name == "sync_cost":  # on a GPU in a process of its own (clean CUDA state); emulated copies in this one
            options = {"part": "sync_cost", "tokens": 64 if scale.tiny else 4 * scale.seq}
            record = sync_cost_worker(options, scale) if scale.tiny else run_worker(options, scale, work)
            if "modes" in record:
                record["table"] = sync_cost_table(record)
        elif name == "sync_phases":
            record = sync_phases(scale, work)
        elif name == "trainer_stages":
            record = run_worker({"part": "trainer_stages"}, scale, work)
        else:
            record = nccl_sync_modes(scale, work)
    except Exception as err:  # a part that breaks is reported, and the next part still runs
        traceback.print_exc()
        record = {"error": f"{type(err).__name__}: {err}"}
    return {**record, "seconds": time.monotonic() - start}


def report(results: dict[str, dict], command: str) -> str:
    sections = [f"Command: `{command}`"]
    for name, record in results.items():
        sections.append(f"## {name} ({record.get('seconds', 0):.0f} s)")
        if "skipped" in record or "error" in record:
            output = record.get("output", "")
            sections.append(record.get("skipped") or f"error: {record['error']}\n\n```\n{output}\n```")
        for key in ("table", "phase_table"):
            if key in record:
                sections.append(record[key])
        if name == "trainer_stages" and "sync_audit" in record:
            sections.append(f"val_loss {record['val_loss']:.4f}, test_loss {record['test_loss']:.4f}, module on "
                            f"{record['module_device']}; sync audit: {json.dumps(record['sync_audit'])}")  # fmt: skip
        if name == "nccl_sync_modes" and "bit_identical_to_deepspeed" in record:
            sections.append(f"bit-identical to DeepSpeed alone: {record['bit_identical_to_deepspeed']}")
    return "\n\n".join(sections) + "\n"


def prepare_wheels(target: Path) -> None:
    """Wheels for Python 3.12 on x86-64 Linux of what the GPU image lacks; DeepSpeed built without its ops."""
    from importlib.metadata import version

    target.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version(name)}" for name in CARRIED_PACKAGES]
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["--platform=manylinux2014_x86_64"]
    built = [p for p in pins if p.startswith("deepspeed")]
    pip = [sys.executable, "-m", "pip"]
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(target), *built], check=True, env=env)
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version=3.12",
                    "--implementation=cp", *platforms, "-d", str(target), *[p for p in pins if p not in built]],
                   check=True)  # fmt: skip
    print("\n".join(sorted(path.name for path in target.glob("*.whl"))))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "results"), "gpu_evidence"))
    parser.add_argument("--tiny", action="store_true", help="CPU processes, a tiny model, 2-3 steps")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds; parts that would start later skip")
    parser.add_argument("--steps", type=int, help="measured steps per throughput configuration (default 30)")
    parser.add_argument("--prepare-wheels", metavar="FOLDER", help="write the wheels a bare GPU image lacks, then stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))
    if args.prepare_wheels:
        prepare_wheels(Path(args.prepare_wheels))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    scale = TINY if args.tiny else GPU
    scale = replace(scale, steps=args.steps) if args.steps else scale
    deadline = time.monotonic() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gpu_evidence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict[str, dict] = {"setup": {"command": command, "scale": asdict(scale), **versions()}}
    with tempfile.TemporaryDirectory(prefix="gpu_evidence-") as scratch:
        for name in parts:
            print(f"== {name}", flush=True)
            results[name] = run_part(name, scale, Path(scratch), deadline)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            (out / "results.md").write_text(report({k: v for k, v in results.items() if k != "setup"}, command))
            print(report({name: results[name]}, command), flush=True)
    return 1 if any("error" in r for r in results.values()) else 0


def gpu_facts() -> dict:
    """GPU 0's name and memory, asked in a short process: here it would create a CUDA context, whose memory the
    measured processes would then lack."""
    ask = "import json, torch; p = torch.cuda.get_device_properties(0); print(json.dumps([p.name, p.total_memory]))"
    name, memory = json.loads(subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True,
                                             check=True).stdout)  # fmt: skip
    return {"name": name, "memory_bytes": memory}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "deepspeed", "lightning", "transformers"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    device = gpu_facts()["name"] if torch.cuda.is_available() else "cpu"
    return {"versions": found, "device": device, "gpus": torch.cuda.device_count()}


if __name__ == "__main__":
    sys.exit(main())
