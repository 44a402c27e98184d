"""``powerlib measure -- CMD``: a real child process, real signals, the simulated backend."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

import powerlib

SCHEMA = json.loads(
    (Path(powerlib.__file__).parent / "measure_api" / "result.schema.json").read_text()
)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")}
    return env | {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "2",
        "POWERLIB_STATE_DIR": str(tmp_path / "state"),
        "PYTHONWARNINGS": "ignore",
    }


def _measure(tmp_path: Path, *args: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "powerlib.cli", "measure", *args, "--", sys.executable, "-c", code],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _doc(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_exit_status_passes_through_and_json_matches_the_schema(tmp_path: Path) -> None:
    run = _measure(tmp_path, "--json", code="import time; time.sleep(0.5); raise SystemExit(3)")
    assert run.returncode == 3, run.stderr
    doc = _doc(run.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["exit_status"] == 3 and doc["command"][1] == "-c"
    assert len(doc["devices"]) == 2
    assert doc["time_s"] >= 0.5
    idle_w = doc["devices"][0]["average_power_w"]
    assert 20 < idle_w < 100  # an idle simulated A100


def test_killed_child_exits_128_plus_the_signal(tmp_path: Path) -> None:
    run = _measure(
        tmp_path, "--json", code="import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    )
    assert run.returncode == 128 + 9
    assert _doc(run.stdout)["exit_status"] == -9


def test_table_goes_to_stderr_and_the_child_keeps_stdout(tmp_path: Path) -> None:
    run = _measure(tmp_path, code="print('hello from the job')")
    assert run.returncode == 0
    assert run.stdout == "hello from the job\n"
    assert "ENERGY J" in run.stderr and "total" in run.stderr and "exit status 0" in run.stderr


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


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGUSR1])
def test_signals_are_forwarded_to_the_child_once(tmp_path: Path, first: signal.Signals) -> None:
    log, ready = tmp_path / "signals.log", tmp_path / "ready"
    script = tmp_path / "child.py"
    script.write_text(CHILD_WITH_HANDLER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "powerlib.cli", "measure", "--json", "--",
         sys.executable, str(script), str(log), str(ready)],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "no child"
        if first == signal.SIGUSR1:
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            # The child has no SIGUSR1 handler: the default action kills it; powerlib reports it.
            proc.send_signal(signal.SIGUSR1)
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 128 + signal.SIGUSR1, err
            assert _doc(out)["exit_status"] == -signal.SIGUSR1
            return
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert log.read_text().splitlines() == ["SIGINT", "SIGTERM"]  # each once, in order
    assert proc.returncode == 7, err
    assert _doc(out)["exit_status"] == 7


CHILD_WITH_STEPS = """
import time, powerlib
with powerlib.measure() as m:
    for i in range(4):
        with m.step(tokens=512):
            time.sleep(0.12)
    with m.window("eval"):
        time.sleep(0.1)
"""


def test_steps_the_child_measures_are_attributed_and_plotted(tmp_path: Path) -> None:
    plot, jsonl, out = tmp_path / "power.png", tmp_path / "live.jsonl", tmp_path / "result.json"
    run = _measure(
        tmp_path,
        "--json", "--plot", str(plot), "--jsonl", str(jsonl), "--jsonl-interval-s", "0.1",
        "--out", str(out),
        code=CHILD_WITH_STEPS,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = _doc(run.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["steps"] == 4 and doc["tokens"] == 4 * 512
    steps = [w for w in doc["windows"] if w["kind"] == "step"]
    assert [w["index"] for w in steps] == [0, 1, 2, 3]
    for w in steps:
        assert w["time_s"] == pytest.approx(0.12, abs=0.05)
        assert w["energy_j"] == pytest.approx(w["time_s"] * doc["average_power_w"], rel=0.15)
    assert [w["name"] for w in doc["windows"] if w["kind"] == "window"] == ["eval"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) >= 2 * 3  # two devices, a line each every 0.1 s of a > 0.6 s run
    assert {"time_unix_s", "device_id", "energy_j", "power_w", "time_s"} <= lines[0].keys()
    energies = [ln["energy_j"] for ln in lines if ln["index"] == 0]
    assert energies == sorted(energies)


def _strict(text: str) -> dict:
    """JSON as strict parsers read it: ``NaN`` and ``Infinity`` are not JSON."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


CHILD_WITH_INFINITE_TOKENS = """
import os, time
start = time.monotonic()
time.sleep(0.1)
with open(os.environ["POWERLIB_MEASURE_EVENTS"], "a") as f:
    f.write('{"kind": "step", "name": "step", "rank": 0, "start_s": %r, "end_s": %r, '
            '"tokens": 1e999}\\n' % (start, time.monotonic()))
"""


def test_json_output_never_contains_infinity(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run = _measure(tmp_path, "--json", "--out", str(out), code=CHILD_WITH_INFINITE_TOKENS)
    assert run.returncode == 0, run.stderr
    doc = _strict(run.stdout.strip().splitlines()[-1])
    assert _strict(out.read_text()) == doc
    jsonschema.validate(doc, SCHEMA)
    assert doc["steps"] == 1 and doc["windows"][0]["tokens"] is None  # 1e999: not a count
    assert doc["tokens"] is None and doc["energy_per_token_j"] is None


def test_finite_json_writes_null_for_every_non_finite_number() -> None:
    from powerlib.measure_api.result import finite_json

    text = finite_json({"a": [math.inf, {"b": math.nan}], "c": (-math.inf, 1.5), "d": "NaN"})
    assert _strict(text) == {"a": [None, {"b": None}], "c": [None, 1.5], "d": "NaN"}


CHILD_WITH_BAD_EVENTS = """
import os, time, powerlib
with powerlib.measure() as m:
    with m.step(tokens=64):
        time.sleep(0.1)
start = time.monotonic()
time.sleep(0.1)
with open(os.environ["POWERLIB_MEASURE_EVENTS"], "a") as f:
    f.write("[" * 100000 + "]" * 100000 + "\\n")
    f.write('{"kind": "step", "name": "step", "rank": 0, "start_s": %r, "end_s": %r, '
            '"tokens": 1%s}\\n' % (start, time.monotonic(), "0" * 400))
"""


def test_a_bad_events_line_costs_one_warning_not_the_result(tmp_path: Path) -> None:
    run = _measure(tmp_path, "--json", code=CHILD_WITH_BAD_EVENTS)
    assert run.returncode == 0, run.stderr
    doc = _doc(run.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["steps"] == 2 and doc["tokens"] == 64  # 400 digits of tokens: unreported
    warnings = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1, run.stderr
    assert warnings[0].startswith("powerlib: warning: skipped 1 malformed line(s)")
    assert "line 2: JSON nested more than 8 levels deep" in warnings[0]


def test_bad_use_gets_one_clear_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "powerlib.cli", "measure", "--", "/nonexistent/cmd"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 7
    assert run.stderr.strip().splitlines() == [
        "powerlib: error: cannot run '/nonexistent/cmd': No such file or directory"
    ]
    run = subprocess.run(
        [sys.executable, "-m", "powerlib.cli", "measure", "--device", "7", "--", "true"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 6 and "no device with index 7" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
