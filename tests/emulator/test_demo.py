"""`powerlib demo` and `powerlib simulate`: the published GPT-3 175B A100 case, end to end, on
the NVML-like emulated device by default (issue 32) and on the ideal one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerlib.cli import cli
from powerlib.emulator.demo import DEFAULT_P_BLOCK_W, DemoConfig, default_profile, run_demo
from powerlib.emulator.demo_result import DemoResult
from powerlib.emulator.engine import IDEAL_MODEL, NVML_LIKE_MODEL


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
    """The headline figure, on the NVML-like device: the true saving (paired all-max runs on the
    same noise), the planner's prediction and the sessions' own measurement agree."""
    data = demo.to_json()
    assert data["schema"] == "powerlib.demo.v2"
    assert data["model"] == NVML_LIKE_MODEL.to_json()
    assert data["planned_saving_percent"] == data["predicted"]["saving_percent"]
    assert demo.workload.num_microbatches == 12
    assert demo.policy == "fastest"
    # issue 32 targets >= 13.5 % here (benchmarks/fidelity.py); this is the regression floor
    assert demo.saving_percent >= 10.0
    assert demo.slowdown_percent <= 0.1
    predicted = demo.predicted
    assert predicted is not None and predicted.saving_percent is not None
    assert abs(predicted.saving_percent - demo.saving_percent) <= 1.0
    assert predicted.switch_latency_source == "measured"
    measured = demo.measured_by_sessions
    assert measured is not None and measured.verdict == "kept" and measured.rounds == 3
    assert abs(measured.saving_percent - demo.saving_percent) <= 1.0
    # it went through the session phases: profiled on the emulated GPUs, measured P_block
    assert 20 < demo.profile.iterations <= 150
    assert demo.profile.freqs_mhz[0] == 1410.0
    assert demo.apply_started_iteration == demo.profile.iterations
    p_block = demo.profile.measured_p_block_w
    assert all(p == pytest.approx(DEFAULT_P_BLOCK_W, rel=0.1) for p in p_block), p_block
    # each change lands 10-30 ms after the request; the guard plans for a late one
    latency = [s for s in demo.profile.measured_latency_s if s is not None]
    assert len(latency) == 8 and all(0.015 <= s <= 0.04 for s in latency), latency
    assert predicted.switch_latency_s == pytest.approx(max(latency))


def test_on_the_ideal_device_fastest_saves_at_least_14_percent_within_0_1_percent() -> None:
    """The idealized device (exact counter, no noise) validates the planner: the saving it
    predicts is the saving realized."""
    report = run_demo(DemoConfig(model=IDEAL_MODEL, out_dir=None, plot=False, progress=False))
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


def test_simulate_replays_the_saved_plan(demo: DemoResult) -> None:
    iterations = DemoConfig().apply_iterations
    result = CliRunner().invoke(
        cli, ["simulate", demo.outputs["plan.json"], "--iterations", str(iterations), "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == demo.model.to_json()  # the same NVML-like device
    # the same seed and noise draws as the demo's baseline iterations
    assert data["baseline"]["time_s"] == pytest.approx(demo.baseline.time_s, rel=1e-9)
    # the demo measured after minutes of thermal drift; simulate starts cold
    assert data["saving_percent"] == pytest.approx(demo.saving_percent, abs=1.0)
    assert data["slowdown_percent"] <= 0.1


def test_simulate_prints_the_plan_as_a_stage_by_time_grid(demo: DemoResult) -> None:
    plan = demo.outputs["plan.json"]
    result = CliRunner().invoke(cli, ["simulate", plan])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("S") and line[1].isdigit()]
    assert [row.split()[0] for row in rows] == [f"S{s}" for s in range(8)] * 2  # kinds, clocks
    assert len({len(row) for row in rows}) == 1  # one width
    assert lines.index(rows[0]) < next(i for i, ln in enumerate(lines) if "all max clock" in ln)
    assert "energy saved" in lines[-1]
    quiet = CliRunner().invoke(cli, ["simulate", plan, "--no-grid"])
    assert quiet.exit_code == 0 and not any(
        ln.startswith("S0 |") for ln in quiet.stdout.splitlines()
    )


def test_a_straggler_saves_more(demo: DemoResult, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["demo", "--straggler", "1.2", "--json", "--no-plot", "--out-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["policy"] == "deadline"
    # the straggler holds every iteration to 1.2x the all-max iteration
    assert data["workload"]["deadline_s"] == pytest.approx(1.2 * demo.baseline.makespan_s)
    assert data["saving_percent"] > demo.saving_percent + 5.0
    assert data["slowdown_percent"] <= 0.1  # against the straggler's iteration time
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
