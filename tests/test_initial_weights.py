"""The same seed builds the same model under every parallelism (issue 30): ZeRO-1, 2, 3, hpZ 2, on 1, 2 and 4 ranks,
in float32 and in bf16.

Three launches (4, 2 and 1 CPU ranks), each building every model (the quickstart's Llama-2, the Falcon and T5 presets,
a user's own LightningModule) under the layouts of its world size and training one step. Compared: a digest of every
initial parameter and buffer, the initial loss on the first training samples (the same batch whatever the number of
ranks), and the first training loss between layouts of one world size (the same batches).
"""

import math
from types import SimpleNamespace

import pytest
import yaml
from conftest import CONFIGS, REGATHER_EVERY_MODULE, assert_succeeded, run_script

from lightning_hpz.models import get_preset

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
FAMILIES = ("llama2", "falcon", "t5", "user")
ZERO1 = {"stage": 1, "hpz_partition_size": 1, "config": None}
ZERO2 = {"stage": 2, "hpz_partition_size": 1, "config": None}
ZERO3 = {"stage": 3, "hpz_partition_size": 1, "config": REGATHER_EVERY_MODULE}
ZERO3_HPZ2 = {"stage": 3, "hpz_partition_size": 2, "config": REGATHER_EVERY_MODULE}
# launch (world size) -> the layouts it builds (strategy, precision); one hpZ size per launch (DeepSpeed's secondary
# group is global). Under bf16 zero.Init builds the layers in bf16, ZeRO-1/2 in float32 and casts them afterwards.
LAUNCHES = {
    4: {
        "zero1": (ZERO1, "32-true"),
        "zero2": (ZERO2, "32-true"),
        "zero3_hpz2": (ZERO3_HPZ2, "32-true"),
        "zero1_bf16": (ZERO1, "bf16-mixed"),
        "zero3_hpz2_bf16": (ZERO3_HPZ2, "bf16-mixed"),
    },
    2: {"zero1": (ZERO1, "32-true"), "zero3": (ZERO3, "32-true")},
    1: {"zero3": (ZERO3, "32-true")},
}
LAYOUTS = [(ranks, layout) for ranks, layouts in LAUNCHES.items() for layout in layouts]
T5_VOCABULARY = get_preset("t5-tiny").config["vocab_size"]


def _quickstart() -> tuple[dict, dict]:
    """The model and data arguments of configs/quickstart.yaml: the quickstart model is what is compared."""
    config = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    return config["model"]["init_args"], config["data"]["init_args"]


def _job(family: str, layout: str, strategy: dict, precision: str) -> dict:
    model, data = _quickstart()
    if family == "t5":
        model, data = {"preset": "t5-tiny"}, {"input_length": 64, "batch_size": 4}
    elif family == "falcon":
        model, data = {"preset": "falcon-tiny"}, {"sequence_length": 64, "batch_size": 4}
    elif family == "user":
        model, data = {}, {"sequence_length": 64, "batch_size": 4}
    job = {"name": f"{family}/{layout}", "family": family, "steps": 1, "initial_state": True}
    job.update(strategy=strategy, precision=precision)
    return {**job, "model": model, "data": {"source": "default", **data}}


@pytest.fixture(scope="module")
def built(module_tmp):
    """Each rank's record of each job, by world size: ``built.ranks[world][rank]["llama2/zero1"]``."""
    ranks = {}
    for world, layouts in LAUNCHES.items():
        jobs = [_job(family, layout, *settings) for layout, settings in layouts.items() for family in FAMILIES]
        options = {"strategy": ZERO1, "jobs": jobs, "devices": world}
        result = run_script("model_training.py", options, module_tmp / f"ranks{world}", timeout=600, ranks=world)
        assert_succeeded(result, ranks=world)
        ranks[world] = {rank: record["jobs"] for rank, record in result.ranks.items()}
    return SimpleNamespace(ranks=ranks)


def _record(built, family: str, world: int, layout: str, rank: int = 0) -> dict:
    return built.ranks[world][rank][f"{family}/{layout}"]


@pytest.mark.parametrize("family", FAMILIES)
def test_initial_parameters_are_bit_identical_under_every_layout(built, family):
    for world, layout in LAYOUTS:
        reference = _record(built, family, 4, "zero1_bf16" if "bf16" in layout else "zero1")["parameter_digests"]
        for rank in range(world):
            digests = _record(built, family, world, layout, rank)["parameter_digests"]
            differing = sorted(name for name in reference if digests.get(name) != reference[name])
            assert digests.keys() == reference.keys() and not differing, (world, layout, rank, differing)


@pytest.mark.parametrize("family", FAMILIES)
def test_initial_loss_is_identical_under_every_layout(built, family):
    layouts = [(world, layout) for world, layout in LAYOUTS if "bf16" not in layout]
    losses = {(world, layout): _record(built, family, world, layout)["initial_loss"] for world, layout in layouts}
    assert len(set(losses.values())) == 1, losses


@pytest.mark.parametrize("family", FAMILIES)
def test_first_training_loss_is_identical_between_stages_and_hpz(built, family):
    # the measurement: the quickstart's first loss was 5.92599 under ZeRO-1 and 5.97190 under ZeRO-3 + hpZ 2
    for world, layouts in LAUNCHES.items():
        first = {x: _record(built, family, world, x)["losses"][0] for x in layouts if "bf16" not in x}
        assert len(set(first.values())) == 1, (world, first)


@pytest.mark.parametrize("family", FAMILIES)
def test_initial_buffers_are_identical_under_every_layout(built, family):
    # under bf16 zero.Init computed the rotary frequencies in bf16; the strategy computes them again in float32
    for world, layout in LAYOUTS:
        reference = _record(built, family, 4, "zero1_bf16" if "bf16" in layout else "zero1")["buffer_digests"]
        assert _record(built, family, world, layout)["buffer_digests"] == reference, (world, layout)


@pytest.mark.parametrize("family", ["llama2", "falcon"])
def test_bf16_loss_is_identical_for_rotary_models(built, family):
    losses = {layout: _record(built, family, 4, layout)["initial_loss"] for layout in ("zero1_bf16", "zero3_hpz2_bf16")}
    assert len(set(losses.values())) == 1, losses


@pytest.mark.parametrize("family", ["t5", "user"])
def test_bf16_loss_is_identical_without_rotary_buffers(built, family):
    losses = {layout: _record(built, family, 4, layout)["initial_loss"] for layout in ("zero1_bf16", "zero3_hpz2_bf16")}
    assert len(set(losses.values())) == 1, losses


def test_t5_from_scratch_starts_near_the_loss_of_a_uniform_guess(built):
    # transformers' std-1 output projection started mT5 at 36-84; scaled by fan-in it starts near ln(vocabulary)
    first = _record(built, "t5", 4, "zero3_hpz2")["losses"][0]
    assert abs(first - math.log(T5_VOCABULARY)) < 0.2 * math.log(T5_VOCABULARY), first
