"""The data path at scale: prepare-data throughput and memory, training memory per rank, first batch, resume cost.

    python benchmarks/data_at_scale.py --size-mb 2048 --work /tmp/data_at_scale --out results/data_at_scale

Steps (each prints its numbers; all are written to ``OUT/results.json``):
1. generate: a corpus of ``--size-mb`` MB of random words (stdlib ``random``, no download) and a 100 MB one;
2. prepare: ``lightning-hpz prepare-data`` with 1 and 2 workers, MB/s and peak memory of the whole process tree
   (sampled PSS), at the full size and at a quarter of it (flat memory: the peak does not grow with the corpus); with
   the byte tokenizer at ``--size-mb``, and with a BPE tokenizer trained here at ``--bpe-mb`` (far slower);
3. train: 4 CPU ranks on the big and the small shards, each rank's peak RSS and time from ``fit()`` to first batch;
4. resume: on the big shards, the time to the first batch after resuming at the start, a quarter, the middle and the
   end of an epoch,
   against an ordinary DataLoader that skips the consumed batches by iterating over them;
5. quickstart: the prepared stream of the default corpus against the old in-memory path (read all, encode one
   document at a time, ``torch.tensor``), and the validation batches of both.
The work directory is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINING_SCRIPT = REPO / "tests" / "scripts" / "prepared_data_training.py"
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "en", "or", "al", "qu", "is", "th", "de", "pe"]


def generate_corpus(path: Path, size_mb: int, seed: int = 0) -> None:
    """Paragraphs of random words from a 5000-word lexicon, written in 1 MB blocks drawn from 64 distinct ones."""
    if path.is_file() and path.stat().st_size == size_mb << 20:
        return  # kept from an earlier run (--keep)
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(5000)]
    blocks = [_block(rng, lexicon) for _ in range(64)]
    with path.open("w", encoding="utf-8") as file:
        for _ in range(size_mb):
            file.write(rng.choice(blocks))


def _block(rng: random.Random, lexicon: list[str]) -> str:
    paragraphs, size = [], 0
    while size < 1 << 20:
        paragraph = " ".join(rng.choice(lexicon) for _ in range(rng.randint(20, 200))) + ".\n\n"
        paragraphs.append(paragraph)
        size += len(paragraph)
    return "".join(paragraphs)[: 1 << 20]


def train_bpe(sample: Path, out: Path, vocab: int = 8192) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "</s>"])
    with sample.open(encoding="utf-8") as file:
        raw.train_from_iterator((file.read(1 << 20) for _ in range(8)), trainer)
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>").save_pretrained(out)


class TreeMemory:
    """Samples the proportional set size (PSS) of a process and its children: the peak of their real memory."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        import psutil

        self.root, self.interval, self.peak_mb, self.main_rss_mb = psutil.Process(pid), interval, 0.0, 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while self.root.is_running() and self.root.status() != psutil.STATUS_ZOMBIE:
            try:
                processes = [self.root, *self.root.children(recursive=True)]
                total = sum(p.memory_full_info().pss for p in processes) / 2**20
                self.main_rss_mb = max(self.main_rss_mb, self.root.memory_info().rss / 2**20)
            except psutil.Error:
                continue
            self.peak_mb = max(self.peak_mb, total)
            time.sleep(self.interval)


def run_prepare(source: Path, tokenizer: str, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "lightning_hpz.cli", "prepare-data", "--source", str(source), "--tokenizer",
               tokenizer, "--out", str(out), "--num-workers", str(workers), "--quiet"]  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    memory = TreeMemory(process.pid)
    report = process.communicate()[0]
    if process.returncode != 0:
        raise SystemExit(f"prepare-data failed on {source}")
    seconds = time.perf_counter() - started
    megabytes = source.stat().st_size / 1e6
    result = {"workers": workers, "tokenizer": Path(tokenizer).name, "mb": round(megabytes, 1)}
    # The tool's own clock starts after Python's imports (tens of seconds on a busy 2-core machine): the rate a
    # large corpus sees. The wall time includes them.
    result["mb_per_s"] = float(report.rsplit("=", 1)[1].split()[0])
    result |= {
        "seconds": round(seconds, 1),
        "peak_tree_pss_mb": round(memory.peak_mb),
        "main_rss_mb": round(memory.main_rss_mb),
    }
    result["tokens"] = json.loads((out / "manifest.json").read_text())["tokens"]
    print("prepare", json.dumps(result), flush=True)
    return result


def startup_seconds() -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import lightning_hpz.data.preparation"],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return time.perf_counter() - started


def run_training(prepared: Path, out: Path, devices: int, steps: int) -> dict:
    options = {"out": str(out), "data": {"source": str(prepared), "sequence_length": 128, "batch_size": 8},
               "steps": steps, "devices": devices}  # fmt: skip
    completed = subprocess.run(
        [sys.executable, str(TRAINING_SCRIPT), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=out.parent,
    )
    if completed.returncode != 0:
        raise SystemExit(completed.stdout[-3000:] + completed.stderr[-3000:])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
    result = {"shards": str(prepared), "tokens": json.loads((prepared / "manifest.json").read_text())["tokens"]}
    result["peak_rss_mb"] = [round(r["peak_rss_mb"]) for r in ranks]
    result["fit_to_first_batch_seconds"] = [round(r["first_batch_seconds"], 2) for r in ranks]
    print("train", json.dumps(result), flush=True)
    return result


def resume_costs(prepared: Path, skip_batches_iterated: int) -> dict:
    """Time to the first batch after resuming at several positions (this loader) vs iterating over skipped batches."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from lightning_hpz.data import CausalLMDataModule

    started = time.perf_counter()
    data = CausalLMDataModule(source=str(prepared), sequence_length=128, batch_size=8)
    data.trainer = SimpleNamespace(world_size=4, global_rank=1)
    data.setup("fit")
    loader = data.train_dataloader()
    next(iter(loader))
    first_batch = time.perf_counter() - started
    result = {"batches_per_epoch": len(loader), "setup_to_first_batch_seconds": round(first_batch, 4)}
    batches = len(loader)
    positions = [("start", 0), ("quarter", batches // 4), ("middle", batches // 2), ("end", batches - 1)]
    for name, position in positions:
        started = time.perf_counter()
        loader.load_state_dict({"epoch": 0, "batches_consumed": position})
        next(iter(loader))
        result[f"resume_at_{name}_seconds"] = round(time.perf_counter() - started, 4)
    plain = DataLoader(data.train_set, batch_size=8)  # what re-iterating over consumed batches costs
    started = time.perf_counter()
    iterator = iter(plain)
    for _ in range(skip_batches_iterated):
        next(iterator)
    seconds = time.perf_counter() - started
    result["iterating_skip_seconds_per_batch"] = seconds / skip_batches_iterated
    result["iterating_skip_to_middle_seconds_extrapolated"] = round(
        seconds / skip_batches_iterated * len(loader) // 2, 1
    )
    print("resume", json.dumps(result), flush=True)
    return result


def quickstart_identity(cache: Path) -> dict:
    """The quickstart corpus: prepared stream and validation batches against the old in-memory path."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_hpz.data import ByteTokenizer, CausalLMDataModule, pack_tokens, read_corpus

    tokenizer = ByteTokenizer()
    ids: list[int] = []
    for document in read_corpus("default"):
        ids += [*tokenizer.encode(document), tokenizer.eos_id]
    old_blocks = pack_tokens(torch.tensor(ids, dtype=torch.int32), 128)
    data = CausalLMDataModule(sequence_length=128, batch_size=8, cache_dir=str(cache))
    world, identical_val = 4, True
    for rank in range(world):
        data.trainer, data.train_set = SimpleNamespace(world_size=world, global_rank=rank), None
        data.setup("fit")
        split = data.split_point(len(old_blocks))
        sampler = DistributedSampler(
            range(len(old_blocks) - split), num_replicas=world, rank=rank, shuffle=False, drop_last=True
        )
        old_val = [old_blocks[split:][batch] for batch in DataLoader(list(sampler), batch_size=8, drop_last=True)]
        new_val = [batch["input_ids"] for batch in data.val_dataloader()]
        identical_val &= len(old_val) == len(new_val) and all(
            torch.equal(a, b) for a, b in zip(old_val, new_val, strict=True)
        )
    stream = data.shards.read(0, len(data.shards))
    result = {"tokens": len(ids), "stream_identical": bool(np.array_equal(stream, np.array(ids))),
              "validation_batches_identical_4_ranks": identical_val,
              "train_examples": len(data.train_set), "val_examples": len(data.val_set)}  # fmt: skip
    print("quickstart", json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=2048)
    parser.add_argument("--small-mb", type=int, default=100)
    parser.add_argument("--bpe-mb", type=int, default=128, help="corpus size for the BPE tokenizer's runs")
    parser.add_argument("--work", default="/tmp/data_at_scale")
    parser.add_argument("--out", default="results/data_at_scale")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", nargs="*", default=[], choices=["prepare", "bpe", "train", "resume", "quickstart"])
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"size_mb": args.size_mb, "cpus": os.cpu_count(), "startup_seconds": round(startup_seconds(), 1)}
    print("startup (imports) seconds", results["startup_seconds"], flush=True)
    try:
        results |= _measure(args, work)
    finally:
        (out / "results.json").write_text(json.dumps(results, indent=1))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out / 'results.json'}")


def _measure(args: argparse.Namespace, work: Path) -> dict:
    results: dict = {}
    big, quarter, small = work / "big.txt", work / "quarter.txt", work / "small.txt"
    started = time.perf_counter()
    generate_corpus(big, args.size_mb)
    generate_corpus(quarter, max(1, args.size_mb // 4), seed=1)
    generate_corpus(small, args.small_mb, seed=2)
    print(f"generated corpora in {time.perf_counter() - started:.0f} s", flush=True)
    prepared_big, prepared_small = work / "prepared_big", work / "prepared_small"
    runs = [(quarter, "byte", 1, work / "scratch"), (quarter, "byte", 2, work / "scratch")]
    runs += [(big, "byte", 1, work / "scratch"), (big, "byte", 2, prepared_big), (small, "byte", 2, prepared_small)]
    if "bpe" not in args.skip:  # a real subword tokenizer is far slower than bytes: measured on smaller corpora
        train_bpe(small, work / "bpe")
        bpe_big, bpe_quarter = work / "bpe_big.txt", work / "bpe_quarter.txt"
        generate_corpus(bpe_big, args.bpe_mb, seed=3)
        generate_corpus(bpe_quarter, max(1, args.bpe_mb // 4), seed=4)
        runs += [(source, str(work / "bpe"), n, work / "scratch") for source in (bpe_quarter, bpe_big) for n in (1, 2)]
    results["prepare"] = [
        run_prepare(source, tokenizer, out, workers)
        for source, tokenizer, workers, out in runs
        if "prepare" not in args.skip or out != work / "scratch"
    ]
    shutil.rmtree(work / "scratch", ignore_errors=True)
    if "train" not in args.skip:
        results["train"] = [
            run_training(prepared, work / f"train_{name}", args.devices, args.steps)
            for name, prepared in (("big", prepared_big), ("small", prepared_small))
        ]
    if "resume" not in args.skip:
        results["resume"] = resume_costs(prepared_big, skip_batches_iterated=2000)
    if "quickstart" not in args.skip:
        results["quickstart"] = quickstart_identity(work / "quickstart_cache")
    results["summary"] = summary(results)
    print("summary", json.dumps(results["summary"], indent=1), flush=True)
    return results


def summary(results: dict) -> dict:
    """The numbers issue 12 asks for, side by side: rates by worker count, memory growth, per-rank memory ratio."""
    found: dict = {}
    for run in results.get("prepare", []):
        key = f"{run['tokenizer']}_{run['mb']:.0f}mb_{run['workers']}_workers"
        found[f"prepare_mb_per_s_{key}"] = run["mb_per_s"]
        found[f"prepare_peak_mb_{key}"] = {"tree_pss": run["peak_tree_pss_mb"], "main_rss": run["main_rss_mb"]}
    if "train" in results:
        big, small = results["train"]
        found["train_peak_rss_mb_per_rank"] = {"big": big["peak_rss_mb"], "small": small["peak_rss_mb"]}
        found["train_peak_rss_big_over_small"] = round(max(big["peak_rss_mb"]) / max(small["peak_rss_mb"]), 3)
        found["fit_to_first_batch_seconds_big"] = max(big["fit_to_first_batch_seconds"])
    if "resume" in results:
        found |= {k: v for k, v in results["resume"].items() if k.startswith(("resume_at", "setup_to_first"))}
    return found


if __name__ == "__main__":
    main()
