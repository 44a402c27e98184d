"""``--policy power-budget`` in the CLI: ``demo``, ``plan`` and ``kareus plan`` (issue 47, item 1).

``powerlib demo --policy power-budget --budget 0.8`` runs the uniform cap beside the plan on
emulated GPUs; ``powerlib plan PROFILE --policy power-budget`` prints (or writes) the per-stage
limits and clocks; a frontier command that cannot hold a budget says so in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerlib.cli import cli
from powerlib.planning.plan import FrequencyPlan

GPT3 = Path(__file__).parents[2] / "powerlib/emulator/data/gpt3-175b_a100_sxm.csv"
FAST = ["--microbatches", "4", "--truth-iterations", "2", "--ideal", "--no-plot"]
PLAN = [str(GPT3), "--stages", "8", "--microbatches", "12", "--p-block-w", "83.64"]


def _invoke(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, args)
    return result.exit_code, result.stdout, result.stderr


def test_demo_policy_power_budget_json_has_the_uniform_cap_and_the_plan() -> None:
    code, stdout, stderr = _invoke(
        ["demo", "--policy", "power-budget", "--budget", "0.8", *FAST, "--json"]
    )
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["policy"] == "power-budget"
    for name in ("uniform_cap", "powerlib"):
        assert data[name]["time_s"] > 0 and data[name]["energy_j"] > 0
        assert sum(data[name]["limits_w"]) <= data["budget_w"] * (1 + 1e-12)
    assert data["powerlib"]["time_s"] <= data["uniform_cap"]["time_s"]


def test_demo_policy_power_budget_prints_the_uniform_cap_beside_the_plan() -> None:
    code, stdout, stderr = _invoke(["demo", "--policy", "power-budget", "--budget", "0.8", *FAST])
    assert code == 0, stderr
    assert "uniform cap" in stdout and "powerlib" in stdout and "power budget" in stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--policy", "power-budget"], "needs --budget or --budget-w"),
        (["--policy", "fastest", "--budget", "0.8"], "not --policy fastest"),
    ],
)
def test_demo_refuses_a_policy_without_its_budget_or_a_budget_without_its_policy(
    args: list[str], words: str
) -> None:
    code, _, stderr = _invoke(["demo", *args, *FAST])
    assert code == 2 and words in stderr


def test_plan_power_budget_json_and_plan_file(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    code, stdout, stderr = _invoke(
        [
            "plan",
            *PLAN,
            "--policy",
            "power-budget",
            "--budget",
            "0.8",
            "--json",
            "--plan-out",
            str(out),
        ]
    )
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["policy"] == "power-budget"
    assert data["budget_w"] == pytest.approx(0.8 * sum(data["admin_limits_w"]))
    assert data["powerlib"]["sum_w"] <= data["budget_w"] * (1 + 1e-12)
    assert data["powerlib"]["time_s"] <= data["uniform_cap"]["time_s"]
    plan = FrequencyPlan.read(out)
    assert plan.policy == "power-budget"
    assert [plan.power_limit_w(s) for s in range(8)] == pytest.approx(data["powerlib"]["limits_w"])
    for s, clocks in enumerate(data["powerlib"]["clocks_mhz"]):  # each kind at its clock
        assert {p.freq_mhz for p in plan.stage(s)} == set(clocks.values())


def test_plan_power_budget_text_and_its_usage_errors() -> None:
    code, stdout, stderr = _invoke(
        ["plan", *PLAN, "--policy", "power-budget", "--budget-w", "3000"]
    )
    assert code == 0, stderr
    assert "power budget 3000 W for 8 GPUs" in stdout and "uniform cap" in stdout
    assert "stage 7:" in stdout
    code, _, stderr = _invoke(["plan", *PLAN, "--policy", "power-budget"])
    assert code == 2 and "needs --budget or --budget-w" in stderr
    code, _, stderr = _invoke(["plan", *PLAN, "--budget", "0.8"])
    assert code == 2 and "give --policy power-budget" in stderr


def test_plan_never_plans_above_the_given_gpu_limit() -> None:
    code, stdout, stderr = _invoke(
        [
            "plan",
            *PLAN,
            "--policy",
            "power-budget",
            "--budget",
            "0.9",
            "--power-limit-w",
            "350",
            "--json",
        ]
    )
    assert code == 0, stderr
    data = json.loads(stdout)
    assert max(data["powerlib"]["limits_w"]) <= 350.0 and data["admin_limits_w"] == [350.0] * 8


def test_kareus_plan_refuses_a_power_budget_in_one_line(tmp_path: Path) -> None:
    code, _, stderr = _invoke(
        ["kareus", "plan", str(tmp_path), "--microbatches", "4", "--policy", "power-budget"]
    )
    assert code == 2 and "cannot hold a power budget" in stderr
