"""benchmarks/gpu_acceptance.py --smoke: every part of the GPU acceptance run, on the simulator.

The script proves the clock-control path on a real GPU (issue 33, docs/real-gpu.md §9); its
``--smoke`` run keeps it working between GPUs. The simulator's figures are not checked here
(timings on a shared CI core mean nothing): what is checked is that every part A-G runs and
reports its checks, that the checks of powerlib's own mechanics (read-back, landing, apply,
restore, guardian) pass on the simulator, and that no check whose figure would only restate
the simulator's constants is reported as a pass.

The script is a short entry point over ``benchmarks/acceptance/`` (a harness, one module per
part): the rest of this file holds that layout, the harness's report and part loop without a
device, and the exit code without a GPU.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_acceptance.py"
PARTS_DIR = BENCHMARKS / "acceptance"
PART_MODULES = {
    "A": "part_a_environment",
    "B": "part_b_lock_readback",
    "C": "part_c_landing_latency",
    "D": "part_d_profile",
    "E": "part_e_emulated_pipeline",
    "F": "part_f_apply",
    "G": "part_g_restore",
}


def test_the_smoke_run_reports_parts_a_to_g_with_their_checks(tmp_path: Path) -> None:
    out = tmp_path / "acceptance.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["schema"] == "powerlib.bench.gpu_acceptance.v1"
    assert data["smoke"] is True
    assert data["device"]["backend"] == "simulated" and data["device"]["driver"]
    assert list(data["parts"]) == list("ABCDEFG")
    judged = {}
    for key, part in data["parts"].items():
        assert part["checks"], f"part {key} has no checks"
        assert "error" not in part and "skipped" not in part, (key, part)
        assert data["emulation"][key] == part["source"]  # what produced its figures
        for check in part["checks"]:
            assert check["status"] in ("PASS", "smoke", "n/a"), (key, check)
            assert check["criterion"]
            judged[f"{key}.{check['name']}"] = check["status"]
    assert "emulator" in data["emulation"]["E"] and "simulated" in data["emulation"]["A"]
    assert data["emulation"]["E_model"]["switch_latency_s"] > 0  # C's measured latency
    # powerlib's mechanics are judged on the simulator ...
    for name in (
        "A.unlocked_at_start",
        "C.direct_all_landed",
        "C.controller_all_landed",
        "D.torch_layer_stack_on_cpu",
        "F.most_slack_plan_applied",
        "F.released_after_sessions",
        "G.lock_clear_after_exit",
        "G.default_clock_after_exit",
        "G.guardian_restored",
        "G.no_journal_left",
    ):
        torchless = name == "D.torch_layer_stack_on_cpu" and judged[name] == "n/a"  # no torch
        assert judged[name] == "PASS" or torchless, name
    clocks = [name for name in judged if name.startswith("B.clock_")]
    assert len(clocks) == len(data["device"]["clocks_mhz"]) >= 2
    assert all(judged[name] == "PASS" for name in clocks)
    # ... figures that would only restate its constants never pass
    for name in (
        "A.read_state_cost_s",
        "A.counter_period_s",
        "C.controller_max_latency_s",  # a time on a shared CI core
        "G.guardian_recovery_s",
        "D.energy_error_mean",
        "E.reference_saving_gap_points",
        "F.most_slack_saving_gap_points",
    ):
        assert judged[name] == "smoke", name
    assert data["summary"]["verdict"] == "PASS" and "FAIL" not in data["summary"]["checks"]
    for key in "ABCDEFG":  # one line per check on stdout, and the verdict
        assert f" {key}." in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith("PASS:")


# -- the layout: a short entry point, one module per part over a small harness ---------------------


def _entry_point() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_acceptance_entry", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path for `acceptance`
    return module


def test_the_entry_point_runs_parts_a_to_g_one_module_each() -> None:
    entry = _entry_point()
    assert [part.KEY for part in entry.PARTS] == list("ABCDEFG")
    for part in entry.PARTS:
        assert part.__name__ == f"acceptance.{PART_MODULES[part.KEY]}"
        assert Path(part.__file__).parent == PARTS_DIR
        assert part.TITLE and callable(part.run)
        assert part.__doc__ and part.__doc__.startswith(f"{part.KEY}. "), part.__name__
    assert [part.TITLE for part in entry.PARTS] == [
        "environment and read costs",
        "lock read-back at each clock under load",
        "switch landing latency",
        "per-instruction profile against a reference",
        "8-stage pipeline emulated from D's curves",
        "the real apply path",
        "restore after exit and after SIGKILL",
    ]
    assert sorted(p.stem for p in PARTS_DIR.glob("part_*.py")) == sorted(PART_MODULES.values())


def test_the_entry_point_is_short_and_no_module_or_function_is_long() -> None:
    assert len(SCRIPT.read_text().splitlines()) < 150
    for path in [SCRIPT, *sorted(PARTS_DIR.glob("*.py"))]:
        text = path.read_text()
        assert len(text.splitlines()) <= 600, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                assert length <= 80, f"{path.name}:{node.name} has {length} lines"


def test_help_lists_the_flags() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for flag in ("--out", "--device", "--smoke", "--budget-s"):
        assert flag in done.stdout
    assert "proves powerlib's clock-control path on a real GPU" in done.stdout


def test_without_a_gpu_the_real_run_cannot_start(tmp_path: Path) -> None:
    out = tmp_path / "acceptance.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # no GPU for torch, even on a GPU node
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.startswith("gpu_acceptance: ") and "--smoke" in done.stderr
    assert not out.exists()


# -- the harness, without a device -----------------------------------------------------------------


@pytest.fixture
def harness() -> ModuleType:
    _entry_point()
    from acceptance import harness

    return harness


def _rig(harness: ModuleType, tmp_path: Path, *, smoke: bool = True) -> Any:
    return harness.Rig(
        args=None,
        scale=harness.SMOKE,
        smoke=smoke,
        backend=None,
        dev=None,
        work=None,
        report=harness.Report(tmp_path / "report.json", smoke),
        tmp=tmp_path,
    )


def test_a_check_is_judged_only_where_it_means_something(
    harness: ModuleType, tmp_path: Path
) -> None:
    real = harness.Report(tmp_path / "real.json", smoke=False)
    smoke = harness.Report(tmp_path / "smoke.json", smoke=True)
    for report in (real, smoke):
        report.part("A", "title", "source")
        report.check("A", "judged", True, 1.0, "c", judged_in_smoke=True)
        report.check("A", "figure", False, float("nan"), "c")
        report.check("A", "none", None, "why", "c")
        report.save()
    statuses = [c["status"] for c in json.loads(real.path.read_text())["parts"]["A"]["checks"]]
    assert statuses == ["PASS", "FAIL", "n/a"]
    data = json.loads(smoke.path.read_text())
    assert [c["status"] for c in data["parts"]["A"]["checks"]] == ["PASS", "smoke", "n/a"]
    assert data["parts"]["A"]["checks"][1]["value"] is None  # JSON has no NaN
    assert (
        data["schema"] == "powerlib.bench.gpu_acceptance.v1" and data["emulation"]["A"] == "source"
    )
    assert data["summary"]["verdict"] == "PASS"
    assert json.loads(real.path.read_text())["summary"]["verdict"] == "FAIL"
    assert real.verdict_line().startswith("\nFAIL: 1 FAIL, 1 PASS, 1 n/a in ")


def test_a_part_without_its_inputs_is_skipped_and_a_broken_part_fails(
    harness: ModuleType, tmp_path: Path
) -> None:
    from acceptance import part_e_emulated_pipeline, part_f_apply

    rig = _rig(harness, tmp_path)
    harness.run_part(rig, "E", "e", part_e_emulated_pipeline.run)  # no curves from D
    harness.run_part(rig, "F", "f", part_f_apply.run)  # no plan from E

    def broken(rig: Any, part: dict[str, Any]) -> None:
        raise RuntimeError("mended in a hurry")

    harness.run_part(rig, "G", "g", broken)
    data = json.loads(rig.report.path.read_text())
    assert data["parts"]["E"]["skipped"] == "part D produced no curves"
    assert data["parts"]["F"]["skipped"] == "part E produced no plan"
    assert data["parts"]["G"]["error"] == "RuntimeError: mended in a hurry"
    ran = {key: part["checks"][-1] for key, part in data["parts"].items()}
    assert [(c["name"], c["status"]) for c in ran.values()] == [
        ("ran", "n/a"),
        ("ran", "n/a"),
        ("ran", "FAIL"),  # judged even in smoke: the part did not run to its end
    ]
    rig.halt = "the backend may not change clocks here"
    harness.run_part(rig, "B", "b", broken)
    assert rig.report.data["parts"]["B"]["skipped"] == rig.halt


def test_the_clocks_run_from_the_top_down_to_half_of_it(harness: ModuleType) -> None:
    supported = [float(f) for f in range(210, 1981, 15)]
    assert harness.pick_clocks(supported, 4) == [1980.0, 1650.0, 1320.0, 990.0]
    assert harness.pick_clocks([100.0, 200.0], 6) == [200.0, 100.0]
    assert harness.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert harness.gpu_slug("Simulated NVIDIA H100-SXM5-80GB") == "h100"
    assert harness.gpu_slug("Weird Card") == "weird-card"
