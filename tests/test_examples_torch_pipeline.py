"""examples/torch_pipeline.py ends in a verdict (issue 44): it never stops silently in the check.

The example trains until the session's phase is past the check (or a bound), then rank 0 prints
the session's report and one ``powerlib verdict:`` line: the closed loop's measured line, the
reason no plan was applied (``summary.json``'s ``refused``), or that no verdict came in time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.pipelining")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torch_pipeline.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_pipeline_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(**fields: object) -> SimpleNamespace:
    base: dict[str, object] = {"realized": None, "plan": None, "iterations": 7, "phase": "check"}
    return SimpleNamespace(**(base | fields))


def test_the_verdict_line_is_the_closed_loops_when_it_judged(tmp_path: Path) -> None:
    realized = SimpleNamespace(line=lambda: "measured saving 1.00 +- 0.50 %: kept")
    line = _example().verdict_line(_report(realized=realized, plan={"policy": "fastest"}), tmp_path)
    assert line == "powerlib verdict: measured saving 1.00 +- 0.50 %: kept"


def test_the_verdict_line_gives_the_reason_no_plan_was_applied(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"plan": None, "refused": "too noisy"}))
    line = _example().verdict_line(_report(phase="done"), tmp_path)
    assert line == "powerlib verdict: no plan applied: too noisy"


def test_the_verdict_line_says_when_no_verdict_came(tmp_path: Path) -> None:
    line = _example().verdict_line(_report(plan={"policy": "fastest"}), tmp_path)
    assert line == "powerlib verdict: none after 7 iterations (phase check, plan applied)"


def test_the_loop_runs_until_the_verdict() -> None:
    example = _example()
    assert "check" in example.UNDECIDED and "profile" in example.UNDECIDED
    assert "apply" not in example.UNDECIDED and "done" not in example.UNDECIDED


@pytest.mark.slow
@pytest.mark.integration
def test_the_example_ends_in_a_verdict(tmp_path: Path) -> None:
    """Two gloo ranks on simulated GPUs, as its docstring runs it: one verdict line, no check."""
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo is not available")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")} | {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "2",
        "POWERLIB_STATE_DIR": str(tmp_path / "state"),
        "POWERLIB_SIM_TIME_FOLLOWS_CLOCK": "1",  # as the example's docstring runs it
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE)]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    verdicts = [line for line in lines if line.startswith("powerlib verdict: ")]
    assert len(verdicts) == 1, done.stdout
    report = json.loads(next(line for line in lines if line.startswith("{")))
    assert report["phase"] in ("apply", "done"), report
    assert report["iterations"] < 200, report  # the verdict came, not the bound
    if report["realized"] is not None:
        assert verdicts[0].endswith(report["realized"]["verdict"]), verdicts[0]
    else:
        assert "no plan applied" in verdicts[0], verdicts[0]
