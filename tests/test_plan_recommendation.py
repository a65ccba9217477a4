"""``lightning-hpz plan --memory-gib``: the configurations whose model states fit, least communication first, each
with how to run it; nothing fitting is said with what to change."""

from lightning_hpz.cli.plan_command import HOW_TO_RUN, parse_plan_args, plan_entries, recommendation

GIB = 2**30


def _args(memory_gib: float, nodes: int = 4):
    arguments = ["--params", "7e9", "--nodes", str(nodes), "--devices-per-node", "8", "--memory-gib", str(memory_gib)]
    return parse_plan_args(arguments)


def test_only_fitting_configurations_are_listed_least_communication_first():
    args = _args(14)
    text = recommendation(args, 7_000_000_000)
    entries = {e.name: e for e in plan_entries(args, 7_000_000_000)}
    listed = [line.split("GiB  ")[1].split(":")[0] for line in text.splitlines()[1:]]
    assert listed and all(entries[name].memory_bytes <= 14 * GIB for name in listed)
    assert {name for name, e in entries.items() if e.memory_bytes <= 14 * GIB} == set(listed)
    seconds = [entries[name].seconds for name in listed]
    assert seconds == sorted(seconds)
    assert "DDP" not in listed and "ZeRO-1" not in listed  # 100 and 27 GiB of model states


def test_every_configuration_says_how_to_run_it():
    text = recommendation(_args(1e6), 7_000_000_000)
    assert len(text.splitlines()) == 1 + len(plan_entries(_args(1e6), 7_000_000_000))
    assert all(": " in line and not line.endswith(": ") for line in text.splitlines()[1:])
    assert "not this package" in text and 'strategy="hpz"' in text
    assert len(HOW_TO_RUN) == 8


def test_nothing_fitting_names_the_smallest_and_what_to_change():
    text = recommendation(_args(1, nodes=1), 70_000_000_000)
    assert text.startswith("Nothing fits 1 GiB per rank: the least memory is ZeRO-3's")
    assert "Add nodes" in text and "hpz_offload" in text
