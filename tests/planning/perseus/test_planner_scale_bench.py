"""benchmarks/planner_scale.py runs end to end on a small case and reports both solvers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("highspy")
REPO = Path(__file__).resolve().parents[3]


def test_the_scaling_benchmark_compares_direct_and_walk(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "planner_scale.py"), "--stages", "8"]
    cmd += ["--microbatches", "4", "--policies", "fastest", "deadline", "--out", str(out)]
    cmd += ["--no-lowtime"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [c["policy"] for c in data["cases"]] == ["fastest", "deadline"]
    for case in data["cases"]:
        assert case["direct"]["wall_s"] > 0 and case["direct"]["peak_mb"] > 0
        assert case["max_rel_energy_diff"] <= 1e-9
        assert case["same_guard"] is True
    assert data["lowtime_8x24"] is None
