"""End to end on torch.distributed: 4 processes on gloo, one pipeline stage each, simulated GPUs.

A real torch training loop (1F1B, activations and gradients sent between ranks) runs through the
session: every rank profiles, rank 0 gathers the profiles and plans, every rank applies its
stage's plan through its controller thread, and every device is back where it was afterwards.
Then a plan with a wrong order for stage 1 must make stage 1 warn once, reset and keep training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from multiproc import collapse, launch_ranks

from powerlib.config import Settings
from powerlib.control import StateDir
from powerlib.planning.profile import Profile
from powerlib.registry import open_backend

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("dist")
    state = tmp / "state"
    settings = Settings(backend="simulated", sim_gpus=WORLD, state_dir=state)
    with open_backend(settings=settings) as backend:
        original = [d.read_state() for d in backend.devices()]
    outputs = launch_ranks(WORKER, [str(tmp)], WORLD, state)
    with open_backend(settings=settings) as backend:
        final = [d.read_state() for d in backend.devices()]
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {
        "tmp": tmp,
        "state": state,
        "results": results,
        "original": original,
        "final": final,
        "log": outputs[0],
    }


def test_rank0_gathers_every_stage_and_plans(run: dict) -> None:
    profile = Profile.read(run["tmp"] / "auto" / "profile.csv")
    assert profile.num_stages == WORLD
    for stage in range(WORLD):
        for kind in ("forward", "backward"):
            assert [o[0] for o in profile.options(stage, kind)] == [1410.0, 1200.0, 1005.0]
    assert (run["tmp"] / "auto" / "plan.json").exists()
    assert "planning 4 stages x 4 microbatches" in run["log"]


def test_each_rank_applies_exactly_its_stage_of_the_plan(run: dict) -> None:
    plan = json.loads((run["tmp"] / "auto" / "plan.json").read_text())
    started = {res["auto"]["apply_started_iteration"] for res in run["results"]}
    assert len(started) == 1  # every rank ended each block, and the sweep, at the same iteration
    # warm-up, then each of the 3 clocks until it resolved: 1 to 4 measured iterations
    assert 1 + 3 * 1 <= started.pop() <= 1 + 3 * 4
    for r, res in enumerate(run["results"]):
        auto = res["auto"]
        stage_freqs = [i["freq_mhz"] for i in plan["stages"][r]["instructions"]]
        assert auto["plan_freqs"] == stage_freqs
        assert auto["requested"] == stage_freqs  # one request per instruction, in order
        assert auto["applied_first_iteration"] == collapse(stage_freqs)
        assert auto["applied_ok"]
        assert auto["warnings"] == []


def test_every_device_is_back_and_no_journal_is_left(run: dict) -> None:
    for res in run["results"]:
        assert res["after_auto"] == res["before"]
        assert res["after_mismatch"] == res["before"]
    for before, after in zip(run["original"], run["final"]):
        assert after.locked_sm_freqs_mhz == before.locked_sm_freqs_mhz
        assert after.power_limit_w == before.power_limit_w
    journal_dir = StateDir(run["state"]).journal_dir
    assert journal_dir.is_dir()  # the sessions did journal their changes...
    assert list(journal_dir.glob("*.json")) == []  # ...and removed every journal on restore


def test_a_wrong_order_warns_once_on_that_stage_and_training_continues(run: dict) -> None:
    for r, res in enumerate(run["results"]):
        warned = res["mismatch"]["warnings"]
        if r == 1:
            assert len(warned) == 1 and "does not run the plan's instruction order" in warned[0]
            assert res["mismatch"]["phase"] == "done"
        else:
            assert warned == []
            assert res["mismatch"]["phase"] == "apply"
