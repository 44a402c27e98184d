"""``run_command``: ``powerlib measure -- CMD`` as a library call, without click.

Real child processes and real signals on the simulated backend, as tests/cli/test_measure_cli.py
does through the CLI (docs/measurement.md §6).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from powerlib.errors import InvalidArgumentError
from powerlib.measure_api import CommandMeasurement, finite_json, run_command


@pytest.fixture(autouse=True)
def simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two simulated GPUs, for this process and the child (which inherits the environment);
    the state folder is the tmp one that tests/conftest.py sets."""
    monkeypatch.setenv("POWERLIB_BACKEND", "simulated")
    monkeypatch.setenv("POWERLIB_SIM_GPUS", "2")


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def test_the_exit_status_and_the_energy_come_back() -> None:
    run = run_command(_python("import time; time.sleep(0.4); raise SystemExit(3)"))
    assert isinstance(run, CommandMeasurement)
    assert run.exit_status == 3 and run.exit_code == 3
    assert run.command == (sys.executable, "-c", run.command[2])
    res = run.result
    assert len(res.devices) == 2 and res.time_s >= 0.4
    assert res.energy_j > 0 and all(d.energy_j > 0 for d in res.devices)
    assert 20 < res.devices[0].average_power_w < 100  # an idle simulated A100
    doc = json.loads(finite_json(run.to_json()))
    assert doc["exit_status"] == 3 and doc["command"][1] == "-c"
    assert doc["energy_j"] == pytest.approx(res.energy_j)
    assert set(run.power_series) == {d.device_id for d in res.devices}


def test_a_killed_child_is_minus_the_signal_and_128_plus_it_for_a_shell() -> None:
    run = run_command(_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert run.exit_status == -signal.SIGKILL and run.exit_code == 128 + signal.SIGKILL


CHILD_WITH_HANDLER = """
import signal, sys, time, pathlib
log = pathlib.Path(sys.argv[1])
def handler(signum, frame):
    with log.open("a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    if signum == signal.SIGTERM:
        sys.exit(7)
signal.signal(signal.SIGTERM, handler)
signal.signal(signal.SIGINT, handler)
pathlib.Path(sys.argv[2]).write_text("ready")
deadline = time.time() + 60
while time.time() < deadline:
    time.sleep(0.01)
"""


def test_sigint_and_sigterm_sent_to_this_process_reach_the_child_once(tmp_path: Path) -> None:
    log, ready = tmp_path / "signals.log", tmp_path / "ready"
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def send() -> None:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # ours: run_command forwards it to the child
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    run = run_command(_python(CHILD_WITH_HANDLER, str(log), str(ready)))
    sender.join(timeout=60)
    assert log.read_text().splitlines() == ["SIGINT", "SIGTERM"]  # each once, in order
    assert run.exit_status == 7 and run.result.energy_j > 0
    assert {sig: signal.getsignal(sig) for sig in before} == before  # our handlers are back


CHILD_WITH_STEPS = """
import time, powerlib
with powerlib.measure() as m:
    for i in range(4):
        with m.step(tokens=512):
            time.sleep(0.12)
    with m.window("eval"):
        time.sleep(0.1)
"""


def test_the_steps_the_child_measures_get_the_devices_energy(tmp_path: Path) -> None:
    jsonl = tmp_path / "live.jsonl"
    run = run_command(
        _python(CHILD_WITH_STEPS), jsonl=jsonl, jsonl_interval_s=0.1, sample_period_s=0.01
    )
    assert run.exit_status == 0
    res = run.result
    assert res.num_steps == 4 and res.tokens == 4 * 512
    assert [w.index for w in res.steps] == [0, 1, 2, 3]
    for w in res.steps:
        assert w.time_s == pytest.approx(0.12, abs=0.05)
        assert w.energy_j == pytest.approx(w.time_s * res.average_power_w, rel=0.15)
        assert set(w.device_energy_j) == {d.device_id for d in res.devices}
    assert [w.name for w in res.windows if w.kind == "window"] == ["eval"]
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) >= 2 * 3  # two devices, a line each every 0.1 s of a > 0.6 s run
    energies = [ln["energy_j"] for ln in lines if ln["index"] == 0]
    assert energies == sorted(energies)


def test_off_the_main_thread_it_runs_without_forwarding_signals() -> None:
    out: list[CommandMeasurement] = []
    worker = threading.Thread(target=lambda: out.append(run_command(_python("pass"), [0])))
    worker.start()
    worker.join(timeout=60)
    assert out and out[0].exit_status == 0 and len(out[0].result.devices) == 1


def test_bad_use_is_one_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match="no command to run"):
        run_command([])
    with pytest.raises(InvalidArgumentError, match="cannot run '/nonexistent/cmd'"):
        run_command(["/nonexistent/cmd"])
    with pytest.raises(InvalidArgumentError, match="jsonl_interval_s"):
        run_command(["true"], jsonl_interval_s=0.0)
