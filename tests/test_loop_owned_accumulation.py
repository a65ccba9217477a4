"""When the Fabric strategy hands the accumulation boundary to the loop, and what it leaves as configured."""

from lightning_hpz.partitioning.loop_owned_accumulation import LOOP_OWNED_KEY, request_loop_owned_accumulation


def test_the_loop_owns_the_boundary_by_default():
    config = {"gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3, "overlap_comm": True}}
    assert request_loop_owned_accumulation(config)
    assert config[LOOP_OWNED_KEY] is False
    assert config["zero_optimization"]["overlap_comm"] is True  # ZeRO 2/3 keep their overlap


def test_zero_1_gives_up_an_overlap_deepspeed_refuses_with_it():
    config = {"zero_optimization": {"stage": 1, "overlap_comm": True}}
    assert request_loop_owned_accumulation(config)
    assert config["zero_optimization"]["overlap_comm"] is False


def test_a_config_that_counts_micro_steps_or_decides_itself_is_left_alone():
    counting = {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1, "overlap_comm": True}}
    assert not request_loop_owned_accumulation(counting)
    assert LOOP_OWNED_KEY not in counting and counting["zero_optimization"]["overlap_comm"] is True
    managed = {LOOP_OWNED_KEY: True}
    assert not request_loop_owned_accumulation(managed) and managed == {LOOP_OWNED_KEY: True}
    unmanaged = {LOOP_OWNED_KEY: False}
    assert request_loop_owned_accumulation(unmanaged)
