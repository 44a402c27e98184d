"""`powerlib kareus search|plan` (alias `overlap`) end to end on the simulated evaluator (small clock sets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerlib.cli import cli
from powerlib.planning.plan import FrequencyPlan

pytest.importorskip("sklearn")
pytest.importorskip("moocore")

FREQS = "1110,1260,1410"


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("study")
    code, stdout, stderr = _run(
        "overlap",
        "search",
        str(out),
        "--model",
        "qwen3-1.7b",
        "--tp",
        "8",
        "--freqs",
        FREQS,
        "--json",
    )
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["workload"] == "qwen3-1.7b_tp8_mbs8_seq4096"
    assert [r["partition"] for r in data["partitions"]] == [
        "fwd_attn",
        "fwd_mlp",
        "bwd_mlp",
        "bwd_attn",
    ]
    for row in data["partitions"]:
        assert 0 < row["evaluations"] <= min(row["budget"], row["space"])
        assert row["pareto_points"] >= 1
    assert "fwd_attn" in stderr  # progress goes to stderr
    return out


def test_search_writes_a_study_and_resumes_from_its_logs(study: Path) -> None:
    logs = sorted(p.name for p in study.glob("*.jsonl"))
    assert logs == ["bwd_attn.jsonl", "bwd_mlp.jsonl", "fwd_attn.jsonl", "fwd_mlp.jsonl"]
    before = {p: p.read_text() for p in study.glob("*.jsonl")}
    code, stdout, stderr = _run(
        "overlap",
        "search",
        str(study),
        "--model",
        "qwen3-1.7b",
        "--tp",
        "8",
        "--freqs",
        FREQS,
        "--json",
    )
    assert code == 0, stderr
    # Everything was replayed from the logs: nothing new measured, nothing appended.
    assert {p: p.read_text() for p in study.glob("*.jsonl")} == before


def test_plan_writes_a_plan_with_partition_settings(study: Path, tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    code, stdout, stderr = _run(
        "overlap",
        "plan",
        str(study),
        "--microbatches",
        "4",
        "--compare",
        "--json",
        "--plan-out",
        str(plan_path),
        "--frontier-out",
        str(tmp_path / "f.csv"),
    )
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["overlap"]["nanobatch_instructions"] == data["overlap"]["instructions"] == 16
    cmp_ = data["comparison"]
    assert all(d["weakly_dominated"] for d in cmp_["dominance"].values())
    assert cmp_["iso_time_energy_reduction"] > 0.05
    assert data["slowdown_percent"] < 0  # faster than Megatron-LM
    plan = FrequencyPlan.read(plan_path)
    assert plan.workload["kareus"]["workload"] == "qwen3-1.7b_tp8_mbs8_seq4096"
    backward = next(p for p in plan.stage(0) if p.instruction.kind == "backward")
    assert set(backward.overlap) == {
        "recompute_fwd_attn",
        "recompute_fwd_mlp",
        "bwd_mlp",
        "bwd_attn",
    }
    assert backward.freq_mhz in (1110.0, 1260.0, 1410.0)
    assert (tmp_path / "f.csv").read_text().startswith("iteration,time_s")


def test_plan_text_output_and_policies(study: Path) -> None:
    code, stdout, stderr = _run(
        "overlap", "plan", str(study), "--microbatches", "4", "--policy", "min-energy"
    )
    assert code == 0, stderr
    assert "chosen (min-energy)" in stdout and "nanobatched" in stdout
    code, _, stderr = _run(
        "overlap", "plan", str(study), "--microbatches", "4", "--policy", "deadline"
    )
    assert code == 2 and "--deadline-s" in stderr


def test_missing_log_and_bad_input_are_one_line_errors(study: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for p in study.iterdir():
        if p.name != "bwd_mlp.jsonl":
            (partial / p.name).write_bytes(p.read_bytes())
    code, _, stderr = _run("overlap", "plan", str(partial), "--microbatches", "4")
    assert code == 7
    assert stderr.count("\n") == 1 and "--partition bwd_mlp" in stderr
    (partial / "fwd_attn.jsonl").write_text("{not json\n")
    (partial / "bwd_mlp.jsonl").write_bytes((study / "bwd_mlp.jsonl").read_bytes())
    code, _, stderr = _run("overlap", "plan", str(partial), "--microbatches", "4")
    assert code == 7 and "fwd_attn.jsonl, line 1" in stderr
    code, _, stderr = _run("overlap", "plan", str(tmp_path / "nothing"), "--microbatches", "4")
    assert code == 7 and "kareus search" in stderr
    code, _, stderr = _run("overlap", "search", str(tmp_path / "x"), "--stage-layers", "10,10")
    assert code == 7 and "add up to 20" in stderr
    code, _, stderr = _run("overlap", "search", str(tmp_path / "x"), "--freqs", "900:fast")
    assert code == 7 and "--freqs" in stderr
    code, _, stderr = _run("overlap", "search", str(tmp_path / "x"), "--partition", "fwd_qkv_ag")
    assert code == 7 and "unknown partition type" in stderr
    assert not (tmp_path / "x" / "study.json").exists()


def test_kareus_is_the_group_and_overlap_its_alias(study: Path, tmp_path: Path) -> None:
    """Both names run the same commands on the same study and write the same plan."""
    code, stdout, _ = _run("--help")
    assert code == 0 and "kareus" in stdout and "overlap" not in stdout  # the alias is hidden
    plans = []
    for group in ("kareus", "overlap"):
        out = tmp_path / f"{group}.json"
        code, _, stderr = _run(
            group, "plan", str(study), "--microbatches", "4", "--plan-out", str(out)
        )
        assert code == 0, stderr
        plans.append(out.read_text())
    assert plans[0] == plans[1]
