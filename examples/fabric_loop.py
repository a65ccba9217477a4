"""A custom training loop with Lightning Fabric and stabilized hpZ: 4 CPU processes, hpZ partition size 2.

    python examples/fabric_loop.py                       # 4 CPU processes, Fabric launches them
    python examples/fabric_loop.py --accelerator cuda --devices 8 --num-nodes 2 --hpz auto

A tiny Llama-2 (the ``llama2-tiny`` preset, a plain transformers model) is built sharded under
``fabric.init_module()`` and trained on the text that ships with Python, byte-tokenized. Every ``--check-every``
steps the loop verifies that each hpZ secondary partition matches its primary partitions; at the end it saves a
sharded checkpoint with ``fabric.save``. Nothing is downloaded.
"""

import argparse
import itertools
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_hpz
from lightning_hpz.data import ByteTokenizer, default_corpus, pack_tokens
from lightning_hpz.models import get_preset


def make_data(sequence_length: int, batch_size: int) -> DataLoader:
    tokenizer = ByteTokenizer()
    tokens = torch.tensor([t for document in default_corpus() for t in tokenizer.encode(document)])
    return DataLoader(TensorDataset(pack_tokens(tokens, sequence_length)), batch_size=batch_size, shuffle=True)


def main(args: argparse.Namespace) -> None:
    hpz = args.hpz if args.hpz == "auto" else int(args.hpz)
    strategy = lightning_hpz.HpzFabricStrategy(stage=3, hpz_partition_size=hpz)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)

    with fabric.init_module():  # ZeRO-3 init: each rank allocates only its shard of every weight
        model = LlamaForCausalLM(LlamaConfig(**get_preset("llama2-tiny").config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(make_data(args.sequence_length, args.batch_size))

    losses = []
    for step, (tokens,) in enumerate(itertools.islice(loader, args.steps)):
        loss = model(input_ids=tokens, labels=tokens).loss
        if step % args.check_every == 0:
            # between forward and backward, on every rank: the secondaries backward will read exist now
            fabric.strategy.check_secondary_partitions()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    fabric.save(Path(args.out), {"model": model, "optimizer": optimizer, "step": args.steps})
    fabric.strategy.teardown()  # Fabric never calls it; it undoes what setup installed in DeepSpeed
    fabric.print(
        f"hpZ partition size {strategy.hpz_partition_size}, {args.steps} steps: loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f}; {strategy.secondary_checks_run} secondary-partition checks passed; checkpoint {args.out}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--hpz", default="2", help="hpZ partition size, or 'auto' (devices per node)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default="checkpoints/fabric_loop")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
