"""One predicted figure per plan (issue 44): ``summary.json``'s ``saving_percent`` and
``slowdown_percent`` are per iteration, as the job runs it, and the planning log line, a session's
``Prediction``, ``powerlib plan`` and its ``--json`` all give that figure; the Perseus figure at the
plan's own time is ``saving_at_plan_time_percent`` and is never printed as "saves"."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

import powerlib
from powerlib.cli import cli
from powerlib.planning.perseus.report import PLAN_SUMMARY_SCHEMA
from powerlib.planning.profile import Profile
from powerlib.planning.workflow import PlanRequest, SessionInputs, plan_profile
from powerlib.progress import Progress
from powerlib.runtime.records import Prediction

BLOCKING_W = 83.64 * 8  # FILE's P_block, 8 stages
GPT3 = Path(__file__).parents[2] / "powerlib/emulator/data/gpt3-175b_a100_sxm.csv"
SCHEMA = json.loads(
    (Path(powerlib.__file__).parent / "planning/perseus/plan_summary.schema.json").read_text()
)
FILE = PlanRequest(num_stages=8, num_microbatches=4, p_block_w=83.64, unit_time_s=0.001)
SESSION = replace(
    FILE,
    p_block_w=None,
    switch_latency_s=0.02,
    time_cv=0.01,
    time_se=0.001,
    session=SessionInputs(p_block_w=80.0, switch_latency_source="measured"),
)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.read(GPT3)


@pytest.mark.parametrize("policy", ["fastest", "min-energy"])
def test_the_log_line_the_prediction_and_summary_json_give_one_figure(
    profile: Profile, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = plan_profile(profile, replace(SESSION, policy=policy, say=Progress(True)))
    info = result.summary
    line = next(ln for ln in capsys.readouterr().err.splitlines() if "frontier of" in ln)
    assert "saves" not in line
    said = re.search(r"predicted saving (-?[\d.]+) % per iteration at ([-+][\d.]+) %", line)
    assert said is not None, line
    assert info.saving_percent is not None
    assert float(said[1]) == pytest.approx(info.saving_percent, abs=0.005)
    assert float(said[2]) == pytest.approx(info.slowdown_percent, abs=0.0005)
    prediction = Prediction.from_summary(info)
    assert prediction is not None
    assert (prediction.saving_percent, prediction.slowdown_percent) == (
        info.saving_percent,
        info.slowdown_percent,
    )
    data = json.loads(json.dumps(info.to_json()))
    assert data["schema"] == PLAN_SUMMARY_SCHEMA == "powerlib.plan-summary.v2"
    assert (data["saving_percent"], data["slowdown_percent"]) == (
        info.saving_percent,
        info.slowdown_percent,
    )
    jsonschema.validate(data, SCHEMA)
    # no nested figure shares the name with another meaning
    nested = [k for v in data.values() if isinstance(v, dict) for k in v]
    assert not {"saving_percent", "slowdown_percent"} & set(nested)


def test_per_iteration_is_the_replayed_plan_against_all_max_at_its_own_time(
    profile: Profile,
) -> None:
    info = plan_profile(profile, FILE).summary
    it, chosen = info.per_iteration, info.chosen
    assert (it.time_s, it.energy_j) == (chosen.realized_time_s, chosen.realized_energy_j)
    assert it.baseline_time_s == info.baseline.own_time_s
    assert info.saving_percent == pytest.approx(100.0 * (1.0 - it.energy_j / it.baseline_energy_j))
    assert info.slowdown_percent == pytest.approx(100.0 * (it.time_s / it.baseline_time_s - 1.0))


def test_min_energy_differs_from_the_perseus_figure_by_the_baselines_blocking_energy(
    profile: Profile,
) -> None:
    """Slower than T_min, the plan is charged against all-max at its own iteration time by the
    Perseus convention: all-max plus blocking power for the extra time. Per iteration, the job's
    all-max iteration lasts T_min and draws no more."""
    info = plan_profile(profile, replace(FILE, policy="min-energy")).summary
    base, it = info.baseline, info.per_iteration
    assert base.time_s > base.own_time_s * 1.05  # the plan is much slower than all-max
    extra_j = BLOCKING_W * (base.time_s - base.own_time_s)
    assert base.energy_j - it.baseline_energy_j == pytest.approx(extra_j, rel=1e-9)
    assert info.saving_at_plan_time_percent is not None and info.saving_percent is not None
    assert info.saving_at_plan_time_percent > info.saving_percent + 1.0
    assert info.slowdown_percent > 5.0


def test_under_a_deadline_both_iterations_are_held_to_the_stragglers_time(
    profile: Profile,
) -> None:
    result = plan_profile(profile, replace(FILE, policy="deadline", deadline_ratio=1.2))
    info, t_prime = result.summary, result.deadline_s
    assert t_prime is not None
    it, chosen = info.per_iteration, info.chosen
    assert it.baseline_time_s == pytest.approx(t_prime)
    assert it.time_s == pytest.approx(max(t_prime, chosen.realized_time_s))
    held_j = BLOCKING_W * (it.time_s - chosen.realized_time_s)
    assert it.energy_j == pytest.approx(chosen.realized_energy_j + held_j, rel=1e-12)
    all_max = result.frontier.baseline()
    held_base_j = BLOCKING_W * (t_prime - all_max.time_s)
    assert it.baseline_energy_j == pytest.approx(all_max.energy_j + held_base_j, rel=1e-12)
    assert abs(info.slowdown_percent) <= 0.1  # against the straggler's iteration time


def test_powerlib_plan_prints_and_emits_the_per_iteration_figure(tmp_path: Path) -> None:
    argv = ["plan", str(GPT3), "--stages", "8", "--microbatches", "4", "--p-block-w", "83.64"]
    argv += ["--unit-time-s", "0.001"]
    as_json = CliRunner().invoke(cli, [*argv, "--json"])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    jsonschema.validate(data, SCHEMA)
    text = CliRunner().invoke(cli, argv)
    assert text.exit_code == 0, text.output
    assert "saves" not in text.stdout
    predicted = next(ln for ln in text.stdout.splitlines() if ln.startswith("predicted"))
    assert f"saving {data['saving_percent']:.2f} % at {data['slowdown_percent']:+.3f} %" in (
        predicted
    )
    perseus = f"({data['saving_at_plan_time_percent']:.2f} % less at the plan's time"
    assert perseus in text.stdout


def test_a_session_summary_with_its_refusal_fits_the_schema(profile: Profile) -> None:
    late = replace(SESSION, policy="deadline", deadline_s=0.01)
    data = json.loads(json.dumps(plan_profile(profile, late).summary.to_json()))
    assert "refused" in data and "switch_latency_source" in data
    jsonschema.validate(data, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**data, "schema": "powerlib.plan-summary.v1"}, SCHEMA)
    assert SCHEMA["properties"]["schema"]["const"] == PLAN_SUMMARY_SCHEMA
