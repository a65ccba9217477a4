"""lightning_hpz's models under real DeepSpeed ZeRO-3 + hpZ on 4 CPU processes (three launched scripts)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REGATHER_EVERY_MODULE, assert_succeeded, run_script
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM

from lightning_hpz.data import CausalLMDataModule, SpanCorruptionDataModule, default_corpus
from lightning_hpz.models import T5, Falcon, Llama2

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
WORLD = 4
STEPS = 24
PROBE = torch.randint(3, 259, (2, 16), generator=torch.Generator().manual_seed(0))
FAMILIES = ("llama2", "falcon", "t5")
MODELS = {"llama2": Llama2, "falcon": Falcon, "t5": T5}


def _hf_logits(directory) -> torch.Tensor:
    with torch.no_grad():
        return LlamaForCausalLM.from_pretrained(directory).eval()(input_ids=PROBE).logits


def _family_job(family: str, source: str, **model) -> dict:
    data = {"input_length": 64} if family == "t5" else {"sequence_length": 64}
    return {
        "name": family,
        "family": family,
        "steps": STEPS,
        "model": {"preset": f"{family}-tiny", "learning_rate": 3e-3, "warmup_steps": 3, **model},
        "data": {"source": source, "batch_size": 4, **data},
    }


@pytest.fixture(scope="module")
def run(module_tmp):
    """One launch per ZeRO-3 + hpZ training: DeepSpeed creates its hpZ process group once per process.

    The Llama-2 launch first loads a saved tiny model under ZeRO-2, then trains it under ZeRO-3 + hpZ (activation
    checkpointing on, a small .txt corpus so that the run spans two epochs) and exports it.
    """
    small_corpus = module_tmp / "small.txt"
    small_corpus.write_text("\n\n".join(default_corpus())[:25_000])  # ~23 steps per epoch
    torch.manual_seed(1)
    saved = Llama2(preset="llama2-tiny")
    saved.configure_model()
    saved.export(str(module_tmp / "pretrained"))
    pretrained = {"pretrained": str(module_tmp / "pretrained")}
    zero2_load = {
        **_family_job("llama2", "default", **pretrained),
        "name": "pretrained_zero2",
        "steps": 1,
        "probe": PROBE.tolist(),
        "strategy": {"stage": 2, "hpz_partition_size": 1, "config": None},
    }
    llama2 = _family_job(
        "llama2",
        str(small_corpus),
        activation_checkpointing=True,
        export_dir=str(module_tmp / "exported"),
        **pretrained,
    )
    launches = {
        "llama2": [zero2_load, {**llama2, "probe": PROBE.tolist()}],
        "falcon": [_family_job("falcon", "default")],
        "t5": [_family_job("t5", "default")],
    }
    strategy = {"stage": 3, "hpz_partition_size": 2, "config": REGATHER_EVERY_MODULE}
    records = {}
    for name, jobs in launches.items():
        options = {"strategy": strategy, "jobs": jobs}
        result = run_script("model_training.py", options, module_tmp / name, timeout=600, ranks=4)
        assert_succeeded(result)
        for rank, record in result.ranks.items():
            records.setdefault(rank, {}).update(record["jobs"])
    return SimpleNamespace(tmp=module_tmp, ranks=records)


def _job(run, name, rank=0):
    return run.ranks[rank][name]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_learns_under_hpz(run, family):
    losses = _job(run, family)["losses"]
    assert len(losses) == STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses
    # initialised as transformers initialises the model (not with PyTorch's layer defaults), though built sharded
    reference = _initial_loss(family, run.tmp / "token_cache")
    assert abs(losses[0] - reference) < 0.25 * reference, (losses[0], reference)


def _initial_loss(family: str, cache_dir: Path) -> float:
    """Loss of the same preset built whole in this process (transformers' own init) on a few training batches."""
    data_class, length = (
        (SpanCorruptionDataModule, "input_length") if family == "t5" else (CausalLMDataModule, "sequence_length")
    )
    data = data_class(batch_size=4, cache_dir=str(cache_dir), **{length: 64})
    data.setup("fit")
    torch.manual_seed(0)
    module = MODELS[family](preset=f"{family}-tiny")
    module.configure_model()
    batches = [next(iter(DataLoader(data.train_set, batch_size=4, shuffle=True))) for _ in range(3)]
    with torch.no_grad():
        return sum(module(input_ids=b["input_ids"], labels=b["labels"]).loss.item() for b in batches) / len(batches)


def test_no_sample_seen_twice_across_ranks_in_an_epoch(run):
    per_rank = [_job(run, "llama2", rank)["samples"] for rank in range(WORLD)]
    assert set(per_rank[0]) == {"0", "1"}  # the run covered a whole epoch and part of the next
    for epoch in per_rank[0]:
        seen = [i for record in per_rank for i in record[epoch]]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample reached two ranks"
    assert per_rank[0]["0"][: len(per_rank[0]["1"])] != per_rank[0]["1"]  # a fresh order each epoch


@pytest.mark.parametrize("family", FAMILIES)
def test_zero3_build_holds_a_quarter_of_the_model_per_rank(run, family):
    for rank in range(WORLD):
        record = _job(run, family, rank)
        assert record["materialised_elements"] == 0  # every parameter is partitioned: nothing whole on any rank
        # each tensor is padded to a multiple of the world size, so a shard is at most one element per tensor more
        assert record["full_elements"] / WORLD <= record["local_elements"] < record["full_elements"] / WORLD + 100


def test_pretrained_loads_under_zero3_hpz_and_zero2_with_identical_logits(run):
    expected = _hf_logits(run.tmp / "pretrained")
    for name in ("llama2", "pretrained_zero2"):
        for rank in range(WORLD):
            logits = torch.tensor(_job(run, name, rank)["logits_before"])
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=f"{name} rank {rank}")


def test_export_after_training_holds_the_trained_weights(run):
    exported = _hf_logits(run.tmp / "exported")
    trained = torch.tensor(_job(run, "llama2")["logits_after"])
    torch.testing.assert_close(exported, trained, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(exported, _hf_logits(run.tmp / "pretrained"))  # training moved the weights
