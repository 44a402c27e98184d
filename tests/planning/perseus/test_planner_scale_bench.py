"""benchmarks/planner_scale.py runs end to end on a small case and reports every solver."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_scaling_benchmark_compares_flow_highs_walk_and_the_guard(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "planner_scale.py"), "--cases", "8x4"]
    cmd += ["--policies", "fastest", "deadline", "--out", str(out), "--no-lowtime"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [c["policy"] for c in data["cases"]] == ["fastest", "deadline"]
    have_highs = importlib.util.find_spec("highspy") is not None
    for case in data["cases"]:
        assert case["flow"]["wall_s"] > 0 and case["flow"]["peak_mb"] > 0
        assert ("energy_j" in case["highs"]) is have_highs
        assert "energy_j" in case["walk"]
        assert case["max_rel_cost_diff"] <= 1e-9
        assert case["guard"]["within_limit"] is True
        assert case["guard"]["rel_energy_vs_greedy"] <= 1e-6
    assert data["lowtime_8x24"] is None
