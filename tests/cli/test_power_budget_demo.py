"""``powerlib demo --budget``: the uniform cap beside the plan (issue 47, item 1).

``--budget`` or ``--budget-w`` alone select the power-budget demo; ``--policy power-budget``
(one of the planner's POLICIES) with one of them runs the same demo, and without one is a usage
error (tests/cli/test_power_budget_cli.py).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from powerlib.cli import cli

FAST = ["--microbatches", "4", "--truth-iterations", "2", "--ideal", "--no-plot"]


def _invoke(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["demo", *FAST, *args])
    return result.exit_code, result.stdout, result.stderr


def test_the_json_carries_the_uniform_cap_and_the_plan_with_time_and_energy() -> None:
    code, stdout, stderr = _invoke(["--budget", "0.8", "--json"])
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["policy"] == "power-budget"
    assert data["budget_w"] == pytest.approx(0.8 * sum(data["admin_limits_w"]))
    for name in ("uniform_cap", "powerlib"):
        assert data[name]["time_s"] > 0 and data[name]["energy_j"] > 0
        assert sum(data[name]["limits_w"]) <= data["budget_w"] * (1 + 1e-12)
    assert data["powerlib"]["time_s"] < data["uniform_cap"]["time_s"]


def test_the_table_prints_the_uniform_cap_beside_the_plan() -> None:
    code, stdout, stderr = _invoke(["--budget-w", "3000"])
    assert code == 0, stderr
    assert "power budget 3000 W for 8 GPUs" in stdout
    assert "uniform cap" in stdout and "powerlib" in stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--budget", "0.8", "--budget-w", "3000"], "one of them"),
        (["--budget-w", "0"], "--budget-w must be > 0"),
        (["--budget", "0.3"], "below the 1909 W"),
    ],
)
def test_a_missing_or_impossible_budget_is_one_error_line(args: list[str], words: str) -> None:
    code, _, stderr = _invoke(args)
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("powerlib: error: ")
    assert words in lines[0]


def test_a_budget_with_another_policy_is_refused() -> None:
    result = CliRunner().invoke(cli, ["demo", "--budget", "0.8", "--policy", "fastest", *FAST])
    assert result.exit_code == 2 and "not --policy fastest" in result.stderr
