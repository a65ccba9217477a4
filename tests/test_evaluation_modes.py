"""hpZ under every evaluation context a loop uses: ``torch.inference_mode`` (Lightning on CUDA, and many Fabric
loops), ``no_grad`` (Lightning on gloo) and grad mode, with frozen parameters whose secondary copies live on from
evaluation into training. hpZ changes communication, not arithmetic: every loss equals hpZ 1's.

Each case is one launch of tests/scripts/evaluation_modes.py on 4 CPU processes (real DeepSpeed over gloo).
"""

import pytest
from conftest import REGATHER_EVERY_MODULE, assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess

CASES = {
    "inference_mode_frozen": {"eval_context": "inference_mode", "freeze": True},
    "inference_mode": {"eval_context": "inference_mode", "freeze": False},
    "no_grad_frozen": {"eval_context": "no_grad", "freeze": True},
    "grad_frozen": {"eval_context": "grad", "freeze": True},
}


@pytest.fixture(scope="module")
def hpz1_inference_mode_frozen(module_tmp):
    return _launch(module_tmp, "hpz1", 1, CASES["inference_mode_frozen"])


def _launch(module_tmp, name: str, hpz: int, case: dict):
    strategy = {"hpz_partition_size": hpz, "config": REGATHER_EVERY_MODULE}
    options = {"strategy": strategy, "eval_every": 2, "steps": 6, **case}
    run = run_script("evaluation_modes.py", options, module_tmp / name, ranks=4)
    assert_succeeded(run, ranks=4)
    return run


@pytest.mark.parametrize("case", sorted(CASES))
def test_hpz2_matches_hpz1_whatever_the_evaluation_context(module_tmp, hpz1_inference_mode_frozen, case):
    hpz2 = _launch(module_tmp, f"hpz2_{case}", 2, CASES[case])
    for rank in range(4):
        record, reference = hpz2.ranks[rank], hpz1_inference_mode_frozen.ranks[rank]
        assert record["secondaries_after_eval"] > 0  # hpZ acted: evaluation left secondary copies behind
        assert reference["secondaries_after_eval"] == 0
        # the first evaluation sees the initial weights in every case; the evaluation context changes no number
        assert record["eval_losses"][0] == reference["eval_losses"][0], rank
        if CASES[case]["freeze"]:
            assert record["losses"] == reference["losses"], rank
            assert record["eval_losses"] == reference["eval_losses"], rank
