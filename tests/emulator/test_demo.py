"""`powerlib demo` and `powerlib simulate`: the published GPT-3 175B A100 case, end to end, on
the NVML-like emulated device by default (issue 32) and on the ideal one."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, cast

import jsonschema
import pytest
from click.testing import CliRunner

import powerlib
from powerlib.cli import cli
from powerlib.emulator.demo import (
    DEFAULT_P_BLOCK_W,
    DemoConfig,
    default_profile,
    paired_truth,
    run_demo,
)
from powerlib.emulator.demo_result import DemoResult, DemoTruth
from powerlib.emulator.engine import IDEAL_MODEL, NVML_LIKE_MODEL, Emulator
from powerlib.emulator.noise_model import NoiseDraws
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.schedules import build_schedule


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    out = tmp_path_factory.mktemp("demo")
    return run_demo(DemoConfig(out_dir=str(out), progress=False))


def test_shipped_profile_is_the_artifacts() -> None:
    profile = default_profile()
    assert profile.num_stages == 8
    freqs = [o[0] for o in profile.options(0, "forward")]
    assert freqs[0] == 1410.0 and freqs[-1] == 855.0 and len(freqs) == 38


def test_the_default_nvml_like_demo_saves_what_it_predicts_within_0_1_percent(
    demo: DemoResult,
) -> None:
    """The headline figure, on the NVML-like device: the true saving (the plan against all-max
    on the same noise, paired over 200 draws), the planner's prediction and the sessions' own
    measurement agree."""
    data: dict[str, Any] = demo.to_json()
    assert data["schema"] == "powerlib.demo.v3"
    assert data["model"] == NVML_LIKE_MODEL.to_json()
    assert "planned_saving_percent" not in data and "saving_percent" not in data
    assert demo.workload.num_microbatches == 12
    assert demo.policy == "fastest"
    truth = data["truth"]
    assert list(truth) == [
        "iterations", "saving_percent", "saving_se_percent", "slowdown_percent",
        "slowdown_se_percent",
    ]  # fmt: skip
    assert truth["iterations"] == 200
    assert truth["saving_percent"] == demo.saving_percent == demo.truth.saving_percent
    # paired over 200 draws: a tenth of a point is many standard errors
    assert 0.0 < truth["saving_se_percent"] < 0.02 and 0.0 < truth["slowdown_se_percent"] < 0.02
    # issue 45 targets >= 13.5 % within 0.5 pt of the prediction (benchmarks/fidelity.py,
    # seeds 0-4); this is the regression floor of seed 0 (13.8 % measured)
    assert demo.saving_percent >= 13.0
    assert demo.slowdown_percent <= 0.1
    predicted = demo.predicted
    assert predicted is not None and predicted.saving_percent is not None
    assert abs(predicted.saving_percent - demo.saving_percent) <= 0.5
    assert predicted.switch_latency_source == "measured"
    assert data["predicted"]["saving_percent"] == predicted.saving_percent
    measured = demo.measured_by_sessions
    assert measured is not None and data["measured_by_sessions"] == measured
    # what the sessions measured, paired: within half a point of the truth (0.02 pt, seed 0)
    assert abs(measured["saving_percent"] - demo.saving_percent) <= 0.5
    assert measured["saving_ci_percent"] > 0.0
    # it went through the session phases: profiled on the emulated GPUs, measured P_block
    assert 20 < demo.profile.iterations <= 150
    assert demo.profile.freqs_mhz[0] == 1410.0
    assert demo.apply_started_iteration == demo.profile.iterations
    p_block = demo.profile.measured_p_block_w
    assert all(p == pytest.approx(DEFAULT_P_BLOCK_W, rel=0.1) for p in p_block), p_block
    # each change lands 10-30 ms after the request: the exact replay plans for the median of
    # every rank's landings, the noise stage draws each switch's from them (issue 45)
    latency = [s for s in demo.profile.measured_latency_s if s is not None]
    assert len(latency) == 8 and all(0.015 <= s <= 0.04 for s in latency), latency
    assert predicted.switch_latency_s is not None
    assert 0.015 <= predicted.switch_latency_s < max(latency)


def test_on_the_ideal_device_fastest_saves_at_least_14_percent_within_0_1_percent() -> None:
    """The idealized device (exact counter, no noise) validates the planner: the saving it
    predicts is the saving realized."""
    report = run_demo(  # no noise: a few pairs are the truth
        DemoConfig(model=IDEAL_MODEL, out_dir=None, plot=False, progress=False, truth_iterations=10)
    )
    assert report.model.name == "ideal"
    assert report.saving_percent >= 14.0
    assert report.slowdown_percent <= 0.1
    assert report.predicted is not None and report.predicted.saving_percent is not None
    assert abs(report.predicted.saving_percent - report.saving_percent) <= 0.5
    assert report.apply_started_iteration == report.profile.iterations
    assert report.outputs == {}


def test_demo_writes_its_outputs(demo: DemoResult) -> None:
    outputs = demo.outputs
    for name in (
        "profile.csv",
        "frontier.csv",
        "plan.json",
        "summary.json",
        "frontier.png",
        "timeline.png",
    ):
        path = Path(outputs[name])
        assert path.is_file() and path.stat().st_size > 0, name
    assert Path(outputs["timeline.png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # rank 0's summary.json: the plan-summary schema, and the demo's prediction is its figure
    summary = json.loads(Path(outputs["summary.json"]).read_text())
    schema = Path(powerlib.__file__).parent / "planning/perseus/plan_summary.schema.json"
    jsonschema.validate(summary, json.loads(schema.read_text()))
    predicted = demo.predicted
    assert predicted is not None
    assert (summary["saving_percent"], summary["slowdown_percent"]) == (
        predicted.saving_percent,
        predicted.slowdown_percent,
    )


def test_simulate_replays_the_saved_plan(demo: DemoResult) -> None:
    iterations = demo.truth.iterations
    result = CliRunner().invoke(
        cli, ["simulate", demo.outputs["plan.json"], "--iterations", str(iterations), "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == demo.model.to_json()  # the same NVML-like device
    # the same seed and noise draws as the truth's all-max iterations (time does not drift)
    assert data["baseline"]["time_s"] == pytest.approx(demo.baseline.time_s, rel=1e-9)
    # the truth's own comparison (simulate.v3: the same pairs in the same interleaved order),
    # on GPUs simulate warms first as profiling warmed the demo's. Both request switches up
    # ahead by the lead the plan records, as every session does (the median measured landing).
    # (v2 ran all-max cold, then the plan: it read up to 1 point off.)
    assert data["schema"] == "powerlib.simulate.v3" and data["iterations"] == iterations
    plan = json.loads(Path(demo.outputs["plan.json"]).read_text())
    assert data["request_ahead_s"] == plan["workload"]["request_ahead_s"] > 0
    assert data["saving_percent"] == pytest.approx(demo.saving_percent, abs=0.3)
    assert data["slowdown_percent"] == pytest.approx(demo.slowdown_percent, abs=0.03)


def test_simulate_prints_the_plan_as_a_stage_by_time_grid(demo: DemoResult) -> None:
    plan = demo.outputs["plan.json"]
    result = CliRunner().invoke(cli, ["simulate", plan, "--iterations", "4"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("S") and line[1].isdigit()]
    assert [row.split()[0] for row in rows] == [f"S{s}" for s in range(8)] * 2  # kinds, clocks
    assert len({len(row) for row in rows}) == 1  # one width
    assert lines.index(rows[0]) < next(i for i, ln in enumerate(lines) if "all max clock" in ln)
    assert "energy saved" in lines[-1]
    quiet = CliRunner().invoke(cli, ["simulate", plan, "--no-grid", "--iterations", "4"])
    assert quiet.exit_code == 0 and not any(
        ln.startswith("S0 |") for ln in quiet.stdout.splitlines()
    )


def test_a_straggler_saves_more(demo: DemoResult, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        ["demo", "--straggler", "1.2", "--json", "--no-plot", "--out-dir", str(tmp_path)]
        + ["--truth-iterations", "50"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["policy"] == "deadline"
    # the straggler holds every iteration to 1.2x the all-max iteration
    # (the demo's T is its first all-max iteration; baseline.makespan_s the truth's mean)
    deadline_s = data["workload"]["deadline_s"]
    assert deadline_s == pytest.approx(1.2 * demo.baseline.makespan_s, rel=0.005)
    # all-max is held to T', which carries each iteration's job-wide noise factor (the
    # straggler is a pipeline of the same job: fixed-length noise, 1 % per iteration + drift)
    draws = NoiseDraws(NVML_LIKE_MODEL.noise_model, seed=0)
    common = statistics.fmean(draws.iteration_factor(k) for k in range(1, 51))
    assert data["baseline"]["time_s"] == pytest.approx(deadline_s * common, rel=1e-9)
    truth = data["truth"]
    assert truth["iterations"] == 50
    assert truth["saving_percent"] > demo.saving_percent + 5.0
    assert abs(truth["slowdown_percent"]) <= 0.1  # against the straggler's iteration time
    predicted = data["predicted"]
    assert abs(predicted["saving_percent"] - truth["saving_percent"]) <= 1.0
    assert "powerlib: profiling at" in result.stderr  # progress goes to stderr, not the JSON


def test_simulate_refuses_a_malformed_plan(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"schema": "powerlib.plan.v1", "stages": "all of them"}')
    result = CliRunner().invoke(cli, ["simulate", str(bad)])
    assert result.exit_code == 7
    assert result.stderr.strip().count("\n") == 0 and "plan.json" in result.stderr


def test_demo_refuses_bad_options() -> None:
    result = CliRunner().invoke(cli, ["demo", "--straggler", "0.5"])
    assert result.exit_code == 2
    result = CliRunner().invoke(cli, ["demo", "--truth-iterations", "1"])
    assert result.exit_code == 2  # a standard error needs two pairs


def _all_max_plan(plan_path: str, tmp_path: Path) -> FrequencyPlan:
    """The demo's plan with every clock at the emulated A100's maximum."""
    data = json.loads(Path(plan_path).read_text())
    for stage in data["stages"]:
        for instruction in stage["instructions"]:
            instruction["freq_mhz"] = 1410.0
    path = tmp_path / "all_max.json"
    path.write_text(json.dumps(data))
    return FrequencyPlan.read(path)


def test_the_truth_of_a_plan_at_all_max_is_zero_pair_by_pair(
    demo: DemoResult, tmp_path: Path
) -> None:
    """The truth runs the plan through the session's apply phase and all-max unlocked, on the
    same noise draws: a plan that is all-max measures exactly nothing, pair by pair (without
    thermal drift, which moves between the two blocks of a pair)."""
    profile = default_profile()
    model = dataclasses.replace(NVML_LIKE_MODEL, drift=0.0)
    emulator = Emulator(
        profile, build_schedule("1f1b", 8, 12, 1), p_block_w=DEFAULT_P_BLOCK_W, model=model
    )
    truth = paired_truth(emulator, _all_max_plan(demo.outputs["plan.json"], tmp_path), 12, block=4)
    assert truth.iterations == 12
    assert truth.saving_percent == pytest.approx(0.0, abs=1e-9)
    assert truth.slowdown_percent == pytest.approx(0.0, abs=1e-9)
    assert truth.saving_se_percent < 1e-9 and truth.slowdown_se_percent < 1e-9
    # the demo's own plan on the same emulator saves what the demo's truth says
    plan = FrequencyPlan.read(demo.outputs["plan.json"])
    ours = paired_truth(emulator, plan, 12, block=4)
    assert ours.saving_percent == pytest.approx(demo.saving_percent, abs=0.1)
    assert ours.saving_se_percent > 0.0


def test_the_truths_standard_error_is_the_paired_ratio_estimators() -> None:
    base_j = [100.0, 104.0, 97.0, 101.0, 99.0]
    plan_j = [90.0, 93.0, 87.5, 91.0, 89.0]
    base_s, plan_s = [2.0, 2.1, 1.9, 2.0, 2.0], [2.0, 2.1, 1.91, 2.0, 2.01]

    def runs(times: list[float], energies: list[float]) -> list[Any]:
        return [
            cast(Any, type("Run", (), {"time_s": t, "energy_j": e, "makespan_s": t}))
            for t, e in zip(times, energies, strict=True)
        ]

    truth = DemoTruth.paired(runs(base_s, base_j), runs(plan_s, plan_j))
    r = sum(plan_j) / sum(base_j)
    assert truth.saving_percent == pytest.approx(100.0 * (1.0 - r))
    residuals = [x - r * y for x, y in zip(plan_j, base_j, strict=True)]
    se = statistics.stdev(residuals) / (math.sqrt(5) * statistics.fmean(base_j))
    assert truth.saving_se_percent == pytest.approx(100.0 * se)
    assert truth.slowdown_percent == pytest.approx(100.0 * (sum(plan_s) / sum(base_s) - 1.0))
    # an exact ratio has no error
    exact = DemoTruth.paired(runs(base_s, base_j), runs(base_s, [0.9 * e for e in base_j]))
    assert exact.saving_percent == pytest.approx(10.0) and exact.saving_se_percent < 1e-12
    with pytest.raises(ValueError):
        DemoTruth.paired(runs(base_s[:1], base_j[:1]), runs(plan_s[:1], plan_j[:1]))


def test_the_demo_prints_the_truth_with_its_standard_error_and_each_figure_once(
    demo: DemoResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    import powerlib.emulator.demo as demo_module

    monkeypatch.setattr(demo_module, "run_demo", lambda config: demo)
    out = CliRunner().invoke(cli, ["demo", "--no-plot"])
    assert out.exit_code == 0, out.output
    truth, measured, predicted = demo.truth, demo.measured_by_sessions, demo.predicted
    assert measured is not None and predicted is not None
    assert (
        f"energy saved: {truth.saving_percent:.3f} +- {truth.saving_se_percent:.3f} %  "
        f"(slowdown {truth.slowdown_percent:+.3f} +- {truth.slowdown_se_percent:.3f} %)  "
        f"true, paired with all-max over 200 noise draws (+- 1 SE)"
    ) in out.stdout
    assert f"the sessions measured {measured['saving_percent']:.2f} +- " in out.stdout
    assert f"the planner predicted {predicted.saving_percent:.2f} %" in out.stdout
    unmeasured = dataclasses.replace(demo, measured_by_sessions=None)
    monkeypatch.setattr(demo_module, "run_demo", lambda config: unmeasured)
    out = CliRunner().invoke(cli, ["demo", "--no-plot"])
    assert out.exit_code == 0, out.output
    assert "the sessions reached no measured verdict; the planner predicted" in out.stdout
