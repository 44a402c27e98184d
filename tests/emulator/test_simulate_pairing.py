"""`simulate_plan` and `powerlib simulate` compare a plan with all-max honestly (issue 45).

Like the demo's truth: the emulated GPUs warm up first, then the plan (through the session's
apply phase) and all-max run the same noise draws, in blocks whose order follows the Thue-Morse
sequence, 200 pairs, each figure with its standard error. The old order (all-max cold, then
the plan) read the GPUs' warming as a cost of the plan.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import CliRunner
from runtime_helpers import FREQS, toy_profile

from powerlib.cli import cli
from powerlib.emulator import truth as truth_module
from powerlib.emulator.demo import paired_truth, run_plan, simulate_plan
from powerlib.emulator.demo_result import SIMULATE_SCHEMA, DemoTruth
from powerlib.emulator.engine import NVML_LIKE_MODEL, Emulator
from powerlib.errors import InvalidArgumentError
from powerlib.planning.plan import FrequencyPlan

# Powers rise 5 % with a 30 s time constant: a 4 x 4 toy iteration lasts about 0.55 s, so 200
# all-max iterations then 200 of the plan span the whole warming.
DRIFTING = dataclasses.replace(NVML_LIKE_MODEL, drift=0.05, drift_tau_s=30.0, name="drifting")


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The toy profile (4 stages), its fastest plan (4 microbatches), and that plan at all-max."""
    out = tmp_path_factory.mktemp("toy")
    profile = out / "profile.csv"
    toy_profile().write_csv(profile)
    plan = out / "plan.json"
    argv = ["plan", str(profile), "--stages", "4", "--microbatches", "4", "--p-block-w", "80"]
    result = CliRunner().invoke(cli, [*argv, "--unit-time-s", "0.001", "--plan-out", str(plan)])
    assert result.exit_code == 0, result.output
    data = json.loads(plan.read_text())
    for stage in data["stages"]:
        for instruction in stage["instructions"]:
            instruction["freq_mhz"] = max(FREQS)
    all_max = out / "all_max.json"
    all_max.write_text(json.dumps(data))
    return {"profile": profile, "plan": plan, "all_max": all_max}


def _cold_emulator(plan: FrequencyPlan) -> Emulator:
    schedule = [[p.instruction for p in plan.stage(s)] for s in range(plan.num_stages)]
    return Emulator(toy_profile(), schedule, p_block_w=80.0, model=DRIFTING, seed=0)


def test_an_all_max_plan_saves_nothing_on_warming_gpus(toy: dict[str, Path]) -> None:
    result = simulate_plan(
        str(toy["all_max"]), profile_path=str(toy["profile"]), p_block_w=80.0, model=DRIFTING
    )
    assert result["schema"] == SIMULATE_SCHEMA == "powerlib.simulate.v3"
    assert result["iterations"] == 200
    assert result["warm_up_iterations"] > 0
    assert result["model_description"] == DRIFTING.describe()
    assert abs(result["saving_percent"]) < 0.005
    assert abs(result["slowdown_percent"]) < 1e-9
    assert set(result["baseline"]) == {"time_s", "energy_j", "makespan_s"}
    # The old order on the same GPUs, cold: 200 all-max iterations, then 200 of the same clocks
    # through the apply phase. The powers rose in between: the plan "costs" energy.
    plan = FrequencyPlan.read(toy["all_max"])
    emulator = _cold_emulator(plan)
    base = [emulator.run_iteration(noise_key=k) for k in range(1, 201)]
    old = DemoTruth.paired(base, run_plan(emulator, plan, 200))
    assert old.saving_percent < -0.5
    assert old.saving_percent < -10 * old.saving_se_percent


def test_the_interleaved_order_alone_cancels_the_warming(toy: dict[str, Path]) -> None:
    """Without a warm-up, on the steepest part of the drift: within two standard errors."""
    plan = FrequencyPlan.read(toy["all_max"])
    truth = paired_truth(_cold_emulator(plan), plan, 200, block=5)
    assert truth.saving_se_percent > 0.0
    assert abs(truth.saving_percent) < 2 * truth.saving_se_percent
    assert abs(truth.saving_percent) < 0.03


def test_the_blocks_follow_the_thue_morse_order(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []

    def run(time_s: float) -> Any:
        return type("Run", (), {"time_s": time_s, "energy_j": 10.0, "makespan_s": time_s})()

    class Fake:
        devices = [type("Device", (), {"switch_latency_s": 0.02, "latency_spread": 0.5})()]
        clock = type("Clock", (), {"now_s": 0.0, "advance_to": lambda self, t_s: None})()

        def run_iteration(self, *, noise_key: int) -> Any:
            order.append("A")
            return run(1.0 + noise_key)

    def fake_run_plan(
        emulator: Any, plan: Any, count: int, *, first_key: int, lead_s: Any = None
    ) -> list[Any]:
        order.extend("P" * count)
        return [run(1.0 + k) for k in range(first_key, first_key + count)]

    monkeypatch.setattr(truth_module, "run_plan", fake_run_plan)
    truth = paired_truth(cast(Emulator, Fake()), cast(FrequencyPlan, None), 16, block=2)
    assert truth.iterations == 16 and truth.slowdown_percent == 0.0
    blocks = "".join(order[i] for i in range(0, 32, 2))  # one letter per half-block
    assert blocks == "AP" "PA" "PA" "AP" "PA" "AP" "AP" "PA"  # fmt: skip


def test_simulate_prints_the_paired_figures_with_their_errors(toy: dict[str, Path]) -> None:
    argv = ["simulate", str(toy["plan"]), "--profile", str(toy["profile"]), "--p-block-w", "80"]
    result = CliRunner().invoke(cli, [*argv, "--iterations", "20", "--no-grid"])
    assert result.exit_code == 0, result.output
    last = result.stdout.splitlines()[-1]
    assert last.startswith("energy saved: ") and "paired with all-max over 20 noise draws" in last
    assert last.count("+-") == 3  # saving +- SE, slowdown +- SE, "(+- 1 SE)"
    as_json = CliRunner().invoke(cli, [*argv, "--iterations", "20", "--json"])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    assert data["schema"] == "powerlib.simulate.v3" and data["iterations"] == 20
    assert f"{data['saving_percent']:.3f} +- {data['saving_se_percent']:.3f} %" in last
    assert data["saving_se_percent"] > 0.0 and data["slowdown_se_percent"] > 0.0
    assert data["saving_percent"] > 5.0  # the toy's fastest plan saves (about 9 %)


def test_simulate_needs_two_pairs_for_a_standard_error(toy: dict[str, Path]) -> None:
    result = CliRunner().invoke(cli, ["simulate", str(toy["plan"]), "--iterations", "1"])
    assert result.exit_code == 2
    with pytest.raises(InvalidArgumentError, match="two pairs"):
        simulate_plan(str(toy["plan"]), profile_path=str(toy["profile"]), iterations=1)


def _with_lead(toy: dict[str, Path], lead: object, name: str) -> Path:
    data = json.loads(toy["plan"].read_text())
    data["workload"]["request_ahead_s"] = lead
    path = toy["plan"].parent / name
    path.write_text(json.dumps(data))
    return path


def test_simulate_requests_ahead_as_the_plans_sessions_do(toy: dict[str, Path]) -> None:
    """A session's plan records its request-ahead lead; simulate applies it unless told not to:
    switches up then land by the instruction's start, so the plan loses less time."""
    plan = _with_lead(toy, 0.03, "plan_lead.json")
    argv = ["simulate", str(plan), "--profile", str(toy["profile"]), "--p-block-w", "80"]
    runs = {}
    for flag in ([], ["--no-request-ahead"]):
        result = CliRunner().invoke(cli, [*argv, "--iterations", "20", "--json", *flag])
        assert result.exit_code == 0, result.output
        runs[bool(flag)] = json.loads(result.stdout)
    assert runs[False]["request_ahead_s"] == 0.03 and runs[True]["request_ahead_s"] is None
    assert runs[False]["slowdown_percent"] < runs[True]["slowdown_percent"] - 0.1
    assert runs[False]["baseline"]["time_s"] == runs[True]["baseline"]["time_s"]
    bad = _with_lead(toy, "soon", "plan_bad_lead.json")
    result = CliRunner().invoke(cli, ["simulate", str(bad), "--profile", str(toy["profile"])])
    assert result.exit_code == 7 and "workload.request_ahead_s" in result.stderr
