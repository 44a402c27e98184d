"""The Perseus planner against exact hand frontiers, lowtime's synthetic and SOSP'24 frontiers,
Table 6, and the invariants a correct Phillips-Dessouky run must satisfy."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerlib import PlanError
from powerlib.cli import cli
from powerlib.planning.perseus import solver as solver_module
from powerlib.planning.perseus.cost_model import TableCostModel
from powerlib.planning.perseus.frontier import Frontier, FrontierSettings, compute_frontier
from powerlib.planning.perseus.solver import PhillipsDessouky
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule

SHARED = Path(__file__).resolve().parents[4] / "shared" / "perseus_validation"
if not SHARED.is_dir():
    pytest.skip(
        "validation data (../shared/perseus_validation) is not present", allow_module_level=True
    )
SYNTH = SHARED / "synthetic"
SOSP = SHARED / "sosp24_emulation"
GPT3_A100 = SOSP / "profile_gpt3-175b_a100_sxm.csv"
ORDERS = {
    "filter-then-subtract": "filter_then_subtract",
    "subtract-then-filter": "subtract_then_filter",
}


# -- hand cases: exact frontiers ---------------------------------------------------------------------


def _hand_cases() -> dict[str, dict]:
    data = json.loads((SHARED / "hand_cases" / "hand_cases.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _solve_hand(case: dict) -> tuple[dict[int, float], dict[int, dict[str, int]], PhillipsDessouky]:
    names = list(case["ops"])
    index = {n: i for i, n in enumerate(names)}
    models = [TableCostModel({int(k): v for k, v in case["ops"][n].items()}) for n in names]
    solver = PhillipsDessouky(len(names), [(index[a], index[b]) for a, b in case["edges"]], models)
    costs = {solver.makespan(): solver.total_cost()}
    durations = {solver.makespan(): dict(zip(names, solver.durations))}
    for step in solver.run():
        costs[step.quant_time] = step.cost
        durations[step.quant_time] = dict(zip(names, step.durations))
    return costs, durations, solver


@pytest.mark.parametrize("name", sorted(_hand_cases()))
def test_hand_cases_give_exactly_the_listed_frontier(name: str) -> None:
    case = _hand_cases()[name]
    costs, _, _ = _solve_hand(case)
    expected = {int(k): v for k, v in case["expected"].items()}
    assert sorted(costs) == sorted(expected)
    for t, cost in expected.items():
        assert costs[t] == pytest.approx(cost, abs=1e-9), f"{name} at makespan {t}"


def test_the_bridge_case_slows_an_activity_back_down() -> None:
    """H3: a greedy crash-only step would cost 6.5 at makespan 5; PD un-crashes C for 6."""
    case = _hand_cases()["H3_bridge_needs_slowdown"]
    _, durations, _ = _solve_hand(case)
    assert durations[5] == case["expected_durations"]["5"]


def test_h4_blocking_power_puts_the_energy_minimum_at_t_star() -> None:
    case = _hand_cases()["H4_1f1b_N2_M2"]
    costs, _, _ = _solve_hand(case)
    example = case["blocking_example"]
    energy = {
        t: c + example["num_stages"] * example["P_block_per_unit"] * t for t, c in costs.items()
    }
    t_star = min(energy, key=energy.__getitem__)
    assert t_star == example["T_star"] and energy[t_star] == pytest.approx(example["E_at_T_star"])


def test_flat_cost_segments_do_not_stop_the_solver() -> None:
    """Zero marginal cost is a legitimate frontier segment (the reference stops there)."""
    models = [TableCostModel({3: 0.0, 2: 0.0, 1: 5.0}), TableCostModel({2: 0.0, 1: 0.0})]
    solver = PhillipsDessouky(2, [(0, 1)], models)
    steps = list(solver.run())
    assert [s.quant_time for s in steps] == [4, 3, 2]
    assert [s.cost_change for s in steps] == [0.0, 0.0, 5.0]


def test_cycles_and_bad_edges_are_plan_errors() -> None:
    table = TableCostModel({2: 0.0, 1: 1.0})
    with pytest.raises(PlanError, match="cycle"):
        PhillipsDessouky(2, [(0, 1), (1, 0)], [table, table])
    with pytest.raises(PlanError, match="bad edge"):
        PhillipsDessouky(2, [(0, 5)], [table, table])


# -- synthetic 4-stage case and the SOSP'24 emulation ------------------------------------------------


def _frontier(
    profile: Path,
    n: int,
    m: int,
    p_block_w: float,
    order: str = "filter-then-subtract",
    cost_model: str = "exp",
    pruning: str = "weak",
) -> Frontier:
    return compute_frontier(
        Profile.read(profile),
        build_schedule("1f1b", n, m),
        settings=FrontierSettings(
            unit_time_s=1e-3,
            p_block_w=p_block_w,
            order=order,
            cost_model=cost_model,
            pruning=pruning,
        ),
        schedule_name="1f1b",
        num_microbatches=m,
    )


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _assert_matches(
    frontier: Frontier, rows: list[dict[str, str]], time_key: str, energy_key: str
) -> None:
    assert len(frontier.points) == len(rows)
    for point, row in zip(frontier.points, rows):
        assert point.time_s == float(row[time_key])
        assert point.energy_j == pytest.approx(float(row[energy_key]), rel=1e-6)


@pytest.mark.parametrize(
    ("order", "points", "first", "last", "t_star", "t_star_iteration", "e_star"),
    [
        ("filter-then-subtract", 221, (0.930, 598.084), (0.710, 600.731), 0.797, 134, 580.181),
        ("subtract-then-filter", 315, (1.024, 614.507), (0.710, 598.862), 0.806, 219, 575.941),
    ],
)
def test_synthetic_frontier_matches_lowtime(
    order, points, first, last, t_star, t_star_iteration, e_star
) -> None:
    frontier = _frontier(SYNTH / "profile_synth4.csv", 4, 6, 80.0, order, pruning="artifact")
    assert len(frontier.points) == points
    assert (frontier.points[0].time_s, round(frontier.points[0].energy_j, 3)) == first
    assert (frontier.points[-1].time_s, round(frontier.points[-1].energy_j, 3)) == last
    star = frontier.min_energy
    assert (star.time_s, star.iteration, round(star.energy_j, 3)) == (
        t_star,
        t_star_iteration,
        e_star,
    )
    rows = _rows(SYNTH / f"frontier_synth4_mb6_{ORDERS[order]}.csv")
    _assert_matches(frontier, rows, "time", "energy")
    for point, row in zip(frontier.points, rows):  # replaying plans on the measured profile
        realized = frontier.replay(point)
        assert realized.time_s == pytest.approx(float(row["sim_time"]), abs=1e-6)
        assert realized.energy_j == pytest.approx(float(row["sim_energy"]), abs=1e-3)
    base = frontier.baseline()
    assert (round(base.time_s, 6), round(base.energy_j, 4)) == (0.72, 646.2)


def test_gpt3_a100_m12_matches_the_shipped_sosp24_frontier() -> None:
    frontier = _frontier(GPT3_A100, 8, 12, 83.64, pruning="artifact")
    rows = _rows(SOSP / "frontier_gpt3-175b_a100_sxm_mb12.csv")
    _assert_matches(frontier, rows, "time", "energy")
    assert frontier.min_energy.time_s == pytest.approx(3.187)


def test_pure_python_and_compiled_max_flow_give_the_same_frontier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("scipy")
    compiled = _frontier(SYNTH / "profile_synth4.csv", 4, 6, 80.0, "subtract-then-filter")
    monkeypatch.setattr(solver_module, "_SCIPY", [None])
    python = _frontier(SYNTH / "profile_synth4.csv", 4, 6, 80.0, "subtract-then-filter")
    assert [p.quant_time for p in python.points] == [p.quant_time for p in compiled.points]
    for a, b in zip(python.points, compiled.points):
        assert a.energy_j == pytest.approx(b.energy_j, rel=1e-9)


# -- invariants -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "n", "m", "p_block_w", "schedule", "chunks"),
    [
        (SYNTH / "profile_synth4.csv", 4, 6, 80.0, "1f1b", 1),
        (SYNTH / "profile_synth4.csv", 4, 8, 80.0, "gpipe", 1),
        (SYNTH / "profile_synth4.csv", 4, 8, 80.0, "interleaved", 2),
        (GPT3_A100, 8, 12, 83.64, "1f1b", 1),
    ],
)
def test_frontier_invariants(
    profile: Path, n: int, m: int, p_block_w: float, schedule: str, chunks: int
) -> None:
    frontier = compute_frontier(
        Profile.read(profile),
        build_schedule(schedule, n, m, chunks),
        settings=FrontierSettings(unit_time_s=1e-3, p_block_w=p_block_w),
        schedule_name=schedule,
        num_microbatches=m,
        num_chunks=chunks,
    )
    points = frontier.points
    assert len(points) > 10
    quanta = [p.quant_time for p in points]
    assert quanta == list(range(quanta[0], quanta[0] - len(points), -1))  # exactly τ per point
    changes = [p.cost_change_j for p in points]
    assert all(b >= a - 1e-9 for a, b in zip(changes, changes[1:])), "cost change must not decrease"
    assert all(c > 0 for c in changes)
    threshold = n * p_block_w * 1e-3  # energy falls while Δ < N·P_block·τ, then rises
    k = points.index(frontier.min_energy)
    assert k == len(points) - 1 or changes[k + 1] >= threshold - 1e-9
    assert k == 0 or changes[k] <= threshold + 1e-9


def test_policies(tmp_path: Path) -> None:
    frontier = _frontier(SYNTH / "profile_synth4.csv", 4, 6, 80.0)
    assert frontier.select("fastest") is frontier.points[-1]
    assert frontier.select("min-energy") is frontier.min_energy
    assert frontier.select("deadline", 0.85).time_s == pytest.approx(0.85)  # the slowest that fits
    assert frontier.select("deadline", 0.85, argmin=True) is frontier.min_energy  # capped at T*
    assert frontier.select("deadline", 0.78, argmin=True).time_s == pytest.approx(
        0.78
    )  # rules agree
    with pytest.raises(PlanError, match="below the fastest"):
        frontier.select("deadline", 0.5)
    with pytest.raises(PlanError, match="unknown policy"):
        frontier.select("cheapest")


def test_plan_lists_each_stage_in_execution_order() -> None:
    frontier = _frontier(SYNTH / "profile_synth4.csv", 4, 6, 80.0)
    plan = frontier.plan(frontier.fastest, policy="fastest").to_json()
    assert plan["schema"] == "powerlib.plan.v1" and plan["workload"]["num_microbatches"] == 6
    stage0 = [(i["kind"][0].upper(), i["microbatch"]) for i in plan["stages"][0]["instructions"]]
    assert stage0 == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("F", 3),
        ("B", 0),
        ("F", 4),
        ("B", 1),
        ("F", 5),
        ("B", 2),
        ("B", 3),
        ("B", 4),
        ("B", 5),
    ]
    profile_freqs = {row.freq_mhz for row in Profile.read(SYNTH / "profile_synth4.csv").rows}
    assert all(i["freq_mhz"] in profile_freqs for s in plan["stages"] for i in s["instructions"])


# -- the CLI and Table 6 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "saving"), [(12, 15.20), (24, 14.19), (48, 13.62), (96, 13.32)])
def test_table6_savings_come_out_of_powerlib_plan(m: int, saving: float, tmp_path: Path) -> None:
    frontier_csv = tmp_path / "frontier.csv"
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            str(GPT3_A100),
            "--stages",
            "8",
            "--microbatches",
            str(m),
            "--p-block-w",
            "83.64",
            "--unit-time-s",
            "0.001",
            "--frontier-out",
            str(frontier_csv),
            "--pruning",
            "artifact",  # Table 6 is the artifact's: its option pruning reproduces it
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # Table 6 charges all-max at the plan's own time: the Perseus figure, not the per-iteration one
    assert round(data["saving_at_plan_time_percent"], 2) == saving
    rows = _rows(frontier_csv)
    assert len(rows) == data["num_points"] and list(rows[0]) == [
        "iteration",
        "time_s",
        "energy_j",
        "effective_energy_j",
        "cost_change_j",
    ]


def test_plan_cli_writes_plan_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    args = [
        "plan",
        str(SYNTH / "profile_synth4.csv"),
        "--stages",
        "4",
        "--microbatches",
        "6",
        "--p-block-w",
        "80",
        "--unit-time-s",
        "0.001",
        "--policy",
        "deadline",
        "--deadline-s",
        "0.8",
        "--plan-out",
        str(tmp_path / "plan.json"),
        "--plot",
        str(tmp_path / "frontier.png"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "saving" in result.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["time_s"] == pytest.approx(0.8)
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--stages", "5"], 7, "stage"),
        (["--policy", "deadline"], 2, "--deadline-s"),
        (["--policy", "deadline", "--deadline-s", "0.1"], 7, "below the fastest"),
        (["--unit-time-s", "-1"], 2, "unit-time"),  # a usage error: the option says x>0
    ],
)
def test_plan_cli_errors_are_one_line(args: list[str], code: int, words: str) -> None:
    base = {"--stages": "4", "--microbatches": "6", "--p-block-w": "80", "--unit-time-s": "0.001"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["plan", str(SYNTH / "profile_synth4.csv")] + [x for kv in base.items() for x in kv]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == code, result.output
    assert words in result.stderr
    if code != 2:
        assert len(result.stderr.strip().splitlines()) == 1 + ("solving" in result.stderr)


@pytest.mark.parametrize(
    ("args", "recorded"), [([], "weak"), (["--pruning", "artifact"], "artifact")]
)
def test_plan_file_records_the_pruning(args: list[str], recorded: str, tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    argv = ["plan", str(SYNTH / "profile_synth4.csv"), "--stages", "4", "--microbatches", "4"]
    argv += ["--p-block-w", "80", "--unit-time-s", "0.001", "--plan-out", str(plan_path), *args]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    assert json.loads(plan_path.read_text())["workload"]["pruning"] == recorded


def test_plan_cli_refuses_an_unknown_pruning(tmp_path: Path) -> None:
    argv = ["plan", str(SYNTH / "profile_synth4.csv"), "--stages", "4", "--microbatches", "4"]
    argv += ["--p-block-w", "80", "--unit-time-s", "0.001", "--pruning", "strict"]
    argv += ["--plan-out", str(tmp_path / "plan.json")]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output  # a usage error: click lists the choices
    assert "--pruning" in result.stderr and "'weak'" in result.stderr
    assert not (tmp_path / "plan.json").exists()


def test_a_bad_pruning_in_the_settings_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="pruning must be one of .*'strict'"):
        _frontier(SYNTH / "profile_synth4.csv", 4, 4, 80.0, pruning="strict")


def test_a_malformed_profile_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("stage,instruction,frequency,time,energy\n0,forward,1410,-1,5\n")
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            str(bad),
            "--stages",
            "1",
            "--microbatches",
            "2",
            "--p-block-w",
            "80",
            "--unit-time-s",
            "0.001",
        ],
    )
    assert result.exit_code == 7 and "bad.csv" in result.stderr


@pytest.mark.parametrize(
    ("profile", "n", "m", "p_block_w", "raw_slowdown_above", "min_saving", "min_saving_late"),
    [
        # the reference measured +0.35 %; its ~15 ms instructions feel a 5 ms switch latency
        (SYNTH / "profile_synth4.csv", 4, 6, 80.0, 0.0034, 0.06, 0.05),
        (GPT3_A100, 8, 12, 83.64, 0.0010, 0.14, 0.14),
    ],
)
def test_fastest_plan_is_guarded_to_at_most_0_1_percent_slowdown(
    profile: Path,
    n: int,
    m: int,
    p_block_w: float,
    raw_slowdown_above: float,
    min_saving: float,
    min_saving_late: float,
) -> None:
    """Floor quantization makes the raw T_min plan realize slower than all-max; the guard fixes it."""
    frontier = _frontier(profile, n, m, p_block_w)
    all_max_s = frontier.baseline_time_s
    raw = frontier.replay(frontier.fastest)
    assert raw.time_s / all_max_s - 1 > raw_slowdown_above  # the problem is real
    guarded = frontier.realized(frontier.within_slowdown(frontier.fastest, 0.001))
    assert guarded.time_s <= all_max_s * 1.001
    assert 1 - guarded.energy_j / frontier.baseline(guarded.time_s).energy_j >= min_saving
    # with a clock-switch latency the guard has more to fix, and still keeps the saving
    late = frontier.within_slowdown(frontier.fastest, 0.001, switch_latency_s=0.005)
    with_latency = frontier.realized(late, switch_latency_s=0.005)
    assert with_latency.time_s <= all_max_s * 1.001
    saving_late = 1 - with_latency.energy_j / frontier.baseline(with_latency.time_s).energy_j
    assert saving_late >= min_saving_late


def test_plan_cli_reports_the_guarded_realized_plan(tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            str(GPT3_A100),
            "--stages",
            "8",
            "--microbatches",
            "12",
            "--p-block-w",
            "83.64",
            "--unit-time-s",
            "0.001",
            "--json",
            "--plan-out",
            str(plan_path),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["slowdown_percent"] <= 0.1 and data["saving_percent"] >= 14.0
    assert data["replay"]["instructions_sped_up"] >= 1
    frontier = _frontier(GPT3_A100, 8, 12, 83.64)
    # the CLI's guard plans for its default 5 ms clock-switch latency
    guarded = [
        o.freq_mhz for o in frontier.within_slowdown(frontier.fastest, switch_latency_s=0.005)
    ]
    written = json.loads(plan_path.read_text())
    by_node = {}
    for stage in written["stages"]:
        for node, ins in zip(frontier.dag.stage_order(stage["stage"]), stage["instructions"]):
            by_node[node] = ins["freq_mhz"]
    assert [by_node[i] for i in range(len(guarded))] == guarded
