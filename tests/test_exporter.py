"""The Prometheus exporter: a real HTTP scrape on 127.0.0.1, parsed with prometheus_client's parser."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import powerlib  # noqa: E402
from powerlib.backends.simulated import SimulatedBackend  # noqa: E402
from powerlib.config import Settings  # noqa: E402
from powerlib.exporter import Exporter  # noqa: E402


def _scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    families = {}
    for fam in text_string_to_metric_families(text):
        families[fam.name] = fam.samples
    return families


def _value(samples: list, uuid: str, name: str | None = None) -> float:
    (s,) = [s for s in samples if s.labels.get("UUID") == uuid and (name is None or s.name == name)]
    return s.value


def test_scrape_reports_every_device_in_base_units_with_dcgm_labels(settings: Settings) -> None:
    backend = SimulatedBackend(Settings(state_dir=settings.state_dir, sim_gpus=3))
    dev = backend.devices()[1]
    dev.lock_sm_clocks(1005.0, 1200.0)
    dev.set_power_limit(300.0)
    with Exporter(backend=backend, port=0, addr="127.0.0.1", interval_s=0.05) as exp:
        time.sleep(0.3)
        fams = _scrape(exp.port)
        state = dev.read_state()
    uuid = dev.device_id
    info = [s for s in fams["powerlib_device_info"] if s.labels["UUID"] == uuid]
    labels = info[0].labels
    assert labels["gpu"] == "1" and labels["device"] == "nvidia1"
    assert labels["modelName"] == dev.info.name and labels["backend"] == "simulated"
    assert labels["energy_source"] == "counter" and labels["Hostname"]
    assert _value(fams["powerlib_device_sm_clock_hertz"], uuid) == pytest.approx(
        state.sm_freq_mhz * 1e6
    )
    assert _value(fams["powerlib_device_locked_sm_clock_min_hertz"], uuid) == 1005e6
    assert _value(fams["powerlib_device_locked_sm_clock_max_hertz"], uuid) == 1200e6
    assert _value(fams["powerlib_device_power_limit_watts"], uuid) == 300.0
    lo, hi = dev.info.power_limit_range_w
    assert _value(fams["powerlib_device_power_limit_min_watts"], uuid) == lo
    assert _value(fams["powerlib_device_power_limit_max_watts"], uuid) == hi
    assert _value(fams["powerlib_device_power_watts"], uuid) == pytest.approx(
        state.power_w, rel=0.05
    )
    energy = _value(
        fams["powerlib_device_energy_joules"], uuid, "powerlib_device_energy_joules_total"
    )
    # the counter at the cached reading: at most a scrape (the first takes ~0.5 s) old
    assert state.energy_j - 2.0 * state.power_w <= energy <= state.energy_j
    assert 0 < time.time() - _value(fams["powerlib_device_sample_timestamp_seconds"], uuid) < 5
    per_device = sum(
        1 for samples in fams.values() for s in samples if s.labels.get("UUID") == uuid
    )
    assert per_device <= 20
    # No side effects: the exporter read, it did not touch the settings.
    after = dev.read_state()
    assert after.locked_sm_freqs_mhz == (1005.0, 1200.0) and after.power_limit_w == 300.0


def test_a_scrape_is_served_from_the_cache(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = SimulatedBackend(Settings(state_dir=settings.state_dir, sim_gpus=8))
    calls = []
    for dev in backend.devices():
        original = dev.read_state

        def counted(original=original):
            calls.append(1)
            return original()

        monkeypatch.setattr(dev, "read_state", counted)
    with Exporter(backend=backend, port=0, addr="127.0.0.1", interval_s=3600) as exp:
        before = len(calls)
        for _ in range(20):
            fams = _scrape(exp.port)
        assert len(calls) == before  # twenty scrapes, no device call
        assert len(fams["powerlib_device_info"]) == 8


def test_energy_counter_grows_between_samples(settings: Settings) -> None:
    backend = SimulatedBackend(Settings(state_dir=settings.state_dir, sim_gpus=1))
    uuid = backend.devices()[0].device_id
    with Exporter(backend=backend, port=0, addr="127.0.0.1", interval_s=0.05) as exp:
        time.sleep(0.2)
        first = _value(_scrape(exp.port)["powerlib_device_energy_joules"], uuid)
        time.sleep(0.5)
        second = _value(_scrape(exp.port)["powerlib_device_energy_joules"], uuid)
    power = backend.devices()[0].read_state().power_w
    assert second - first == pytest.approx(power * 0.5, rel=0.5)


def test_in_process_sessions_publish_their_steps(settings: Settings) -> None:
    backend = SimulatedBackend(Settings(state_dir=settings.state_dir, sim_gpus=1))
    with Exporter([], port=0, addr="127.0.0.1") as exp:
        with powerlib.measure(backend=backend) as m:
            for _ in range(3):
                with m.step(tokens=100):
                    time.sleep(0.05)
            fams = _scrape(exp.port)
        after = _scrape(exp.port)
    (steps,) = fams["powerlib_session_steps"]
    assert steps.value == 3.0 and steps.name == "powerlib_session_steps_total"
    tokens = [s for s in fams["powerlib_session_tokens"] if s.name.endswith("_total")]
    assert tokens[0].value == 300.0
    count = [s for s in fams["powerlib_session_step_seconds"] if s.name.endswith("_count")]
    total = [s for s in fams["powerlib_session_step_seconds"] if s.name.endswith("_sum")]
    assert count[0].value == 3 and total[0].value == pytest.approx(0.15, abs=0.05)
    assert "powerlib_device_info" not in fams  # devices=[]: sessions only
    assert after.get("powerlib_session_steps", []) == []  # an ended measurement is gone


def test_textfile_mode_writes_atomically_and_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")} | {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "2",
        "POWERLIB_STATE_DIR": str(tmp_path / "state"),
    }
    out = tmp_path / "powerlib.prom"
    run = subprocess.run(
        [sys.executable, "-m", "powerlib.cli", "exporter", "--textfile", str(out), "--once"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    fams = {f.name: f for f in text_string_to_metric_families(out.read_text())}
    assert len(fams["powerlib_device_info"].samples) == 2
    assert fams["powerlib_device_energy_joules"].type == "counter"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("powerlib.prom")] == [
        "powerlib.prom"
    ]  # no temporary file left next to it


def test_exporter_cli_serves_until_sigterm(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")} | {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "1",
        "POWERLIB_STATE_DIR": str(tmp_path / "state"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "powerlib.cli", "exporter", "--port", "0", "--addr", "127.0.0.1",
         "--interval-s", "0.1"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        assert "http://127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        assert len(_scrape(port)["powerlib_device_info"]) == 1
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_a_taken_port_is_one_clear_error(settings: Settings) -> None:
    import socket

    backend = SimulatedBackend(Settings(state_dir=settings.state_dir, sim_gpus=1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(
            powerlib.InvalidArgumentError, match=f"cannot listen on 127.0.0.1:{port}"
        ):
            Exporter(backend=backend, port=port, addr="127.0.0.1").start()
